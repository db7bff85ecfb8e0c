"""Selection: one walk of the tree, and one record per module a request selects.

Requests and override patterns are compiled into one ``PatternSet`` and matched in a single walk
(Rust). The walk prunes subtrees no pattern can reach unless that could hide something: a family
member (when a family class is declared), or an alias of a selected module (which keys it when it
comes first, and may place it inside another bound module). A request pattern that selects no
module but selects parameters plans the modules holding them: the requests are rewritten to name
those modules, and the tree walked again. A selection given the model's whole walk
(``model_index.walk_whole``, which the model index is made of) walks nothing: it matches the
walk's names again (``PatternSet.match_tree``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from operator import is_
from typing import Any, NamedTuple, cast

from torch import nn

from meshbind._core import ModuleTree, PatternSet
from meshbind.errors import PlanProblem, ProblemCode
from meshbind.family import family_classes_declared
from meshbind.specs import ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec, literal_pattern


@dataclass(slots=True)
class PlannedModules:
    """The planned modules, one row each in tree order: row ``r`` of every column is one module's
    record. Each step of resolution reads and extends these columns; a plan of 188k modules is
    ten columns, not 188k objects (making and freeing those costs more than all of validation).
    The two columns few modules fill are dicts keyed by module index."""

    indices: list[int]
    """Each module's index in the walk's tree, ascending."""
    fqns: list[str]
    """Its first FQN in ``named_modules()`` order."""
    modules: list[nn.Module | None]
    """``None`` offline (a plan over a list of FQNs)."""
    classes: list[type | None]
    """The module's class; ``None`` offline."""
    requests: list[int | None]
    """The request that selects it first (``requests[i]``); ``None`` for a family member."""
    specs: list[ParallelModuleSpec]
    sources: list[str]
    """What put it in the plan: ``requests[i]`` or ``family Cls``."""
    other_requests: dict[int, tuple[int, ...]]
    """Module index → the other requests selecting it, ascending; after ownership, each has the
    module's spec (their layouts must agree)."""
    overrides: dict[int, tuple[int, ...]]
    """Module index → the overrides that select it, in the mapping's order."""
    shardings: list[ModuleShardingSpec | None]
    """Each layout: the provider's, overrides merged; ``None`` until provided, or after a problem."""

    def row(self, index: int) -> int:
        """The row of the module with tree index ``index`` (which must be planned)."""
        return bisect_left(self.indices, index)

    def rows(self) -> list[PlannedRow]:
        """Every row, read from the list columns (for the steps that add or drop modules)."""
        return list(map(PlannedRow, *(getattr(self, column) for column in _ROW_COLUMNS)))

    def set_rows(self, rows: Sequence[PlannedRow]) -> None:
        """Replaces the list columns by ``rows``, in tree order; the keyed columns keep only the
        modules still planned."""
        columns: Sequence[Sequence[Any]] = list(zip(*rows, strict=True)) or [()] * len(_ROW_COLUMNS)
        for name, column in zip(_ROW_COLUMNS, columns, strict=True):
            setattr(self, name, list(column))
        kept = set(self.indices)
        self.other_requests = {index: found for index, found in self.other_requests.items() if index in kept}
        self.overrides = {index: found for index, found in self.overrides.items() if index in kept}

    def without(self, indices: set[int]) -> None:
        """Drops the modules of these tree indices."""
        self.set_rows([row for row in self.rows() if row.tree_index not in indices])

    def laid_out(self) -> PlannedModules:
        """The modules with a layout (the others' problems are reported)."""
        if not any(map(is_, self.shardings, repeat(None))):
            return self
        laid_out = replace(self)
        laid_out.set_rows([row for row in self.rows() if row.sharding is not None])
        return laid_out


class PlannedRow(NamedTuple):
    """One row of ``PlannedModules``' list columns."""

    tree_index: int
    fqn: str
    module: nn.Module | None
    cls: type | None
    request: int | None
    spec: ParallelModuleSpec
    source: str
    sharding: ModuleShardingSpec | None


_ROW_COLUMNS = ("indices", "fqns", "modules", "classes", "requests", "specs", "sources", "shardings")
"""``PlannedModules``' list columns, in ``PlannedRow``'s order."""


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
    """What the walk found: the modules requests select, in tree order."""

    requests: list[NativeParallelBindingRequest]
    """The requests, parameter-selecting patterns rewritten to the modules holding them."""
    patterns: PlanPatterns
    tree: ModuleTree
    offline: bool
    planned: PlannedModules
    override_only: dict[int, tuple[int, ...]]
    """Module index → the overrides selecting a module no request selects (a family member may
    still join with them)."""
    problems: list[PlanProblem]


def select_modules(
    model: nn.Module | Sequence[str],
    requests: Sequence[NativeParallelBindingRequest],
    overrides: Sequence[Override],
    *,
    whole: ModuleTree | None = None,
) -> Selection:
    """The walk, parameter-selecting patterns resolved to their modules, and the planned modules.
    ``whole``: the model's whole walk, parameters read (``walk_whole``), matched again instead
    of walking the model."""
    patterns = PlanPatterns.of(requests, overrides)
    tree, offline = _walk(patterns.pattern_set, model, whole)
    if owners := _parameter_owners(model, patterns, tree, whole is not None):
        requests = _selecting_owners(requests, patterns, owners)
        patterns = PlanPatterns.of(requests, overrides)
        tree, offline = _walk(patterns.pattern_set, model, whole)
    planned, override_only = _planned(tree, patterns, requests)
    return Selection(list(requests), patterns, tree, offline, planned, override_only, _cycle_problems(tree))


def _walk(pattern_set: PatternSet, model: object, whole: ModuleTree | None) -> tuple[ModuleTree, bool]:
    """The matches over the model, and whether it is offline (a sequence of FQNs)."""
    if whole is not None:
        return pattern_set.match_tree(whole), False
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


def _planned(
    tree: ModuleTree, patterns: PlanPatterns, requests: Sequence[NativeParallelBindingRequest]
) -> tuple[PlannedModules, dict[int, tuple[int, ...]]]:
    """The modules requests select, from one Rust call; the override-only modules."""
    selected = tree.selected(patterns.request_of, list(range(len(patterns.overrides))))
    indices, fqns, first = selected.module_indices, selected.fqns, selected.first_request
    overrides = {indices[row]: tuple(found) for row, found in selected.overrides}
    other_requests = {indices[row]: tuple(found) for row, found in selected.other_requests}
    modules: list[Any] = selected.modules or [None] * len(indices)  # empty offline
    classes: list[Any] = selected.classes or [None] * len(indices)
    override_only: dict[int, tuple[int, ...]] = {}
    if None in first:  # rows only overrides select are not planned
        override_only = {indices[row]: overrides.pop(indices[row]) for row, request in enumerate(first) if request is None}
        rows = [row for row, request in enumerate(first) if request is not None]
        indices, fqns, first = [indices[row] for row in rows], [fqns[row] for row in rows], [first[row] for row in rows]
        modules, classes = [modules[row] for row in rows], [classes[row] for row in rows]
    owners = cast(list[int], first)
    specs = [request.parallel for request in requests]
    labels = [f"requests[{index}]" for index in range(len(requests))]
    planned = PlannedModules(
        indices,
        fqns,
        modules,
        classes,
        cast(list[int | None], owners),
        list(map(specs.__getitem__, owners)),
        list(map(labels.__getitem__, owners)),
        other_requests,
        overrides,
        [None] * len(indices),
    )
    return planned, override_only


def _parameter_owners(model: object, patterns: PlanPatterns, tree: ModuleTree, read: bool) -> dict[int, list[str]]:
    """Request patterns that select no module but select parameters, by pattern index:
    the FQNs of the modules holding those parameters, in walk order. A walk that ``read`` the
    parameters matched them already; else one pruned walk of just those patterns, only when
    there are some."""
    counts = tree.hit_counts()
    silent = [index for index in range(len(patterns.request_of)) if counts[index] == 0]
    if not silent or not isinstance(model, nn.Module):
        return {}
    if read:
        pattern_of = {pattern: pattern for pattern in silent}
        matches = tree.parameter_matches()
    else:
        pattern_of = dict(enumerate(silent))
        texts = patterns.pattern_set.patterns
        matches = PatternSet([texts[index] for index in silent]).walk(model, prune=True, parameters=True).parameter_matches()
    owners: dict[int, dict[str, None]] = {}
    for name, hits in matches:
        for hit in hits:
            if hit in pattern_of:
                owners.setdefault(pattern_of[hit], {})[name.rpartition(".")[0]] = None
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
