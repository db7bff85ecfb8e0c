"""Selection: one walk of the tree, and one record per module a request selects.

Requests and override patterns are compiled into one ``PatternSet`` and matched in a single walk
(Rust). The walk prunes subtrees no pattern can reach unless that could hide something: a family
member (when a family class is declared), or an alias of a selected module (which keys it when it
comes first, and may place it inside another bound module). A request pattern that selects no
module but selects parameters plans the modules holding them: the requests are rewritten to name
those modules, and the tree walked again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from torch import nn

from meshbind._core import ModuleTree, PatternSet
from meshbind.errors import PlanProblem, ProblemCode
from meshbind.family import family_classes_declared
from meshbind.specs import ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec, literal_pattern


@dataclass(slots=True)
class ModuleRecord:
    """One planned module, filled in as resolution goes."""

    index: int
    """The module's index in the walk's tree."""
    fqn: str
    """Its first FQN in ``named_modules()`` order."""
    module: nn.Module | None
    """``None`` offline (a plan over a list of FQNs)."""
    cls: type | None
    """The module's class; ``None`` offline."""
    request: int | None
    """The request that selects it first (``requests[i]``); ``None`` for a family member."""
    spec: ParallelModuleSpec
    source: str
    """What put it in the plan: ``requests[i]`` or ``family Cls``."""
    other_requests: tuple[int, ...] = ()
    """The other requests selecting it, ascending; after ownership, those with an equal spec
    (their layouts must agree)."""
    overrides: tuple[int, ...] = ()
    """The overrides that select it, in the mapping's order."""
    sharding: ModuleShardingSpec | None = None
    """Its layout: the provider's, overrides merged; ``None`` until provided, or after a problem."""


Override = tuple[str, Mapping[str, Any]]
"""``(pattern, sharding fields)``."""


@dataclass(frozen=True)
class PlanPatterns:
    """Every request's patterns, then every override's, in one set."""

    request_of: list[int]
    """The request owning each request pattern (the set's first ``len(request_of)`` patterns)."""
    overrides: list[Override]
    """The override owning each later pattern."""
    pattern_set: PatternSet

    @staticmethod
    def of(requests: Sequence[NativeParallelBindingRequest], overrides: Sequence[Override]) -> PlanPatterns:
        patterns = [pattern for request in requests for pattern in request.match]
        request_of = [index for index, request in enumerate(requests) for _ in request.match]
        return PlanPatterns(request_of, list(overrides), PatternSet(patterns + [pattern for pattern, _ in overrides]))

    def owned(self) -> list[tuple[str, int | None, int | None]]:
        """``(pattern, request, override)`` for every pattern of the set, one of the two ``None``."""
        texts = self.pattern_set.patterns
        requests = [(texts[i], request, None) for i, request in enumerate(self.request_of)]
        return requests + [(pattern, None, k) for k, (pattern, _) in enumerate(self.overrides)]


@dataclass
class Selection:
    """What the walk found: the records of the modules requests select, in tree order."""

    requests: list[NativeParallelBindingRequest]
    """The requests, parameter-selecting patterns rewritten to the modules holding them."""
    patterns: PlanPatterns
    tree: ModuleTree
    offline: bool
    records: list[ModuleRecord]
    override_only: dict[int, tuple[int, ...]]
    """Module index → the overrides selecting a module no request selects (a family member may
    still join with them)."""
    problems: list[PlanProblem]


def select_modules(
    model: nn.Module | Sequence[str], requests: Sequence[NativeParallelBindingRequest], overrides: Sequence[Override]
) -> Selection:
    """The walk, parameter-selecting patterns resolved to their modules, and the records."""
    patterns = PlanPatterns.of(requests, overrides)
    tree, offline = _walk(patterns.pattern_set, model)
    if owners := _parameter_owners(model, patterns, tree):
        requests = _selecting_owners(requests, patterns, owners)
        patterns = PlanPatterns.of(requests, overrides)
        tree, offline = _walk(patterns.pattern_set, model)
    records, override_only = _records(tree, patterns, requests)
    return Selection(list(requests), patterns, tree, offline, records, override_only, _cycle_problems(tree))


def _walk(pattern_set: PatternSet, model: object) -> tuple[ModuleTree, bool]:
    """The matches over the model, and whether it is offline (a sequence of FQNs)."""
    if isinstance(model, nn.Module):
        if not family_classes_declared():
            tree = pattern_set.walk(model, prune=True, modules=True)
            if not tree.may_share_matches:
                return tree, False
        return pattern_set.walk(model, prune=False), False
    if isinstance(model, str) or not isinstance(model, Sequence):
        raise TypeError(f"model must be an nn.Module or a sequence of FQNs, got {type(model).__name__}")
    names = list(model)
    if len(set(names)) != len(names):
        seen: set[str] = set()
        duplicate = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        raise ValueError(f"the FQN list names {duplicate!r} more than once")
    return pattern_set.index_names(names), True


def _records(
    tree: ModuleTree, patterns: PlanPatterns, requests: Sequence[NativeParallelBindingRequest]
) -> tuple[list[ModuleRecord], dict[int, tuple[int, ...]]]:
    """One record per module a request selects, from one Rust call; the override-only modules."""
    indices, fqns, found_modules, found_classes, first, others, override_hits = tree.selected(
        patterns.request_of, list(range(len(patterns.overrides)))
    )
    modules: list[Any] = found_modules or [None] * len(indices)  # empty offline
    classes: list[Any] = found_classes or [None] * len(indices)
    specs = [request.parallel for request in requests]
    labels = [f"requests[{index}]" for index in range(len(requests))]
    override_only: dict[int, tuple[int, ...]] = {}
    if override_hits:  # rows only overrides select become no record
        hits = {row: tuple(found) for row, found in override_hits}
        override_only = {indices[row]: hits[row] for row, request in enumerate(first) if request is None}
        rows = [row for row, request in enumerate(first) if request is not None]
        indices, fqns, modules, classes, first = (
            [indices[row] for row in rows],
            [fqns[row] for row in rows],
            [modules[row] for row in rows],
            [classes[row] for row in rows],
            [first[row] for row in rows],
        )
    owners = cast(list[int], first)
    records = list(
        map(
            ModuleRecord, indices, fqns, modules, classes, owners, map(specs.__getitem__, owners), map(labels.__getitem__, owners)
        )
    )
    by_row: Mapping[int, ModuleRecord] | list[ModuleRecord] = records
    if override_hits:
        by_row = dict(zip(rows, records, strict=True))
        for row, record in by_row.items():
            record.overrides = hits.get(row, ())
    for row, found in others:
        by_row[row].other_requests = tuple(found)
    return records, override_only


def _parameter_owners(model: object, patterns: PlanPatterns, tree: ModuleTree) -> dict[int, list[str]]:
    """Request patterns that select no module but select parameters, by pattern index:
    the FQNs of the modules holding those parameters, in walk order. One pruned walk of just those
    patterns, only when there are some."""
    counts = tree.hit_counts()
    silent = [index for index in range(len(patterns.request_of)) if counts[index] == 0]
    if not silent or not isinstance(model, nn.Module):
        return {}
    texts = patterns.pattern_set.patterns
    parameters = PatternSet([texts[index] for index in silent]).walk(model, prune=True, parameters=True)
    owners: dict[int, dict[str, None]] = {}
    for name, hits in parameters.parameter_matches():
        for hit in hits:
            owners.setdefault(silent[hit], {})[name.rpartition(".")[0]] = None
    return {index: list(modules) for index, modules in owners.items()}


def _selecting_owners(
    requests: Sequence[NativeParallelBindingRequest], patterns: PlanPatterns, owners: Mapping[int, list[str]]
) -> list[NativeParallelBindingRequest]:
    """The requests with each parameter-selecting pattern replaced by its owning modules' exact FQNs."""
    matches: list[list[str]] = [[] for _ in requests]
    texts = patterns.pattern_set.patterns
    for index, owner in enumerate(patterns.request_of):
        matches[owner] += [literal_pattern(fqn) for fqn in owners[index]] if index in owners else [texts[index]]
    return [replace(request, match=tuple(match)) for request, match in zip(requests, matches, strict=True)]


def _cycle_problems(tree: ModuleTree) -> list[PlanProblem]:
    """An alias that names its own ancestor: the tree has a cycle of shared modules."""
    message = "this FQN names its own ancestor {!r}: the module tree has a cycle of shared modules"
    return [PlanProblem(ProblemCode.LAYOUT, alias, None, message.format(ancestor)) for alias, ancestor in tree.cycles()]
