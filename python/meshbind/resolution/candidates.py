"""The planned modules: one walk of the tree, then one record per module a request or family selects.

Requests and override patterns are compiled into one ``PatternSet`` and matched in a single walk
(Rust). The walk prunes subtrees no pattern can reach unless that could hide something: a family
member (when a family class exists), or an alias of a selected module (which keys it when it
comes first, and may place it inside another bound module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from meshbind._core import ModuleTree, PatternSet
from meshbind.errors import PlanProblem, ProblemCode
from meshbind.family import any_family_class
from meshbind.specs import ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec, literal_pattern

FAMILY = -1
"""The request of a module that joined the plan as a family member."""


@dataclass(slots=True)
class Candidate:
    """One planned module, filled in as resolution goes."""

    index: int
    """The module's index in the walk's tree."""
    fqn: str
    """Its first FQN in ``named_modules()`` order."""
    module: nn.Module | None
    """``None`` offline (a plan over a list of FQNs)."""
    request: int
    """The request that selects it first (``requests[i]``), or ``FAMILY``."""
    spec: ParallelModuleSpec
    source: str
    """What put it in the plan: ``requests[i]`` or ``family Cls``."""
    shared_with: tuple[int, ...] = ()
    """Other requests with an equal spec that select it too (their layouts must agree)."""
    overrides: tuple[int, ...] = ()
    """The overrides that select it, in the mapping's order."""
    sharding: ModuleShardingSpec | None = None
    """Its layout: the provider's, overrides merged; ``None`` until provided, or after a problem."""


@dataclass(frozen=True)
class PlanPatterns:
    """Every request's and override's patterns, in one set: ``owners[i]`` is the request that
    owns pattern ``i`` (``>= 0``) or, for an override ``k``, ``-1 - k``."""

    patterns: list[str]
    owners: list[int]
    pattern_set: PatternSet

    @staticmethod
    def of(requests: Sequence[NativeParallelBindingRequest], overrides: Sequence[tuple[str, Mapping[str, Any]]]) -> PlanPatterns:
        patterns = [pattern for request in requests for pattern in request.match]
        owners = [index for index, request in enumerate(requests) for _ in request.match]
        patterns += [pattern for pattern, _ in overrides]
        owners += [-1 - index for index in range(len(overrides))]
        return PlanPatterns(patterns, owners, PatternSet(patterns))


def walk(pattern_set: PatternSet, model: object) -> tuple[ModuleTree, bool]:
    """The matches over the model, and whether it is offline (a sequence of FQNs)."""
    if isinstance(model, nn.Module):
        if not any_family_class():
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


def parameter_owners(model: object, patterns: PlanPatterns, tree: ModuleTree) -> dict[int, list[str]]:
    """Request patterns that select no module but select parameters, by pattern index:
    the FQNs of the modules holding those parameters, in walk order. One pruned walk of just those
    patterns, only when there are some."""
    counts = tree.hit_counts()
    silent = [index for index, owner in enumerate(patterns.owners) if owner >= 0 and counts[index] == 0]
    if not silent or not isinstance(model, nn.Module):
        return {}
    parameters = PatternSet([patterns.patterns[index] for index in silent]).walk(model, prune=True, parameters=True)
    owners: dict[int, dict[str, None]] = {}
    for name, hits in parameters.parameter_matches():
        for hit in hits:
            owners.setdefault(silent[hit], {})[name.rpartition(".")[0]] = None
    return {index: list(modules) for index, modules in owners.items()}


def selecting_owners(
    requests: Sequence[NativeParallelBindingRequest], patterns: PlanPatterns, owners: Mapping[int, list[str]]
) -> list[NativeParallelBindingRequest]:
    """The requests with each parameter-selecting pattern replaced by its owning modules' exact FQNs."""
    matches: list[list[str]] = [[] for _ in requests]
    for index, (pattern, owner) in enumerate(zip(patterns.patterns, patterns.owners, strict=True)):
        if owner >= 0:
            matches[owner] += [literal_pattern(fqn) for fqn in owners[index]] if index in owners else [pattern]
    return [replace(request, match=tuple(match)) for request, match in zip(requests, matches, strict=True)]


def cycle_problems(tree: ModuleTree) -> list[PlanProblem]:
    """An alias that names its own ancestor: the tree has a cycle of shared modules."""
    message = "this FQN names its own ancestor {!r}: the module tree has a cycle of shared modules"
    return [PlanProblem(ProblemCode.LAYOUT, alias, None, message.format(ancestor)) for alias, ancestor in tree.cycles()]


def candidates_of(
    tree: ModuleTree,
    planned: list[int],
    request_of: list[int],
    requests: Sequence[NativeParallelBindingRequest],
    family_specs: Mapping[int, ParallelModuleSpec],
    module_classes: Sequence[int],
    offline: bool,
) -> list[Candidate]:
    """One record per planned module, in tree order."""
    fqns = tree.module_fqns(planned)
    modules: list[Any] = [None] * len(planned) if offline else tree.modules(planned)
    # FAMILY (-1) reads the placeholder at the end; family rows are filled in below.
    request_specs: list[Any] = [request.parallel for request in requests] + [None]
    labels = [f"requests[{index}]" for index in range(len(requests))] + [""]
    specs = map(request_specs.__getitem__, request_of)
    candidates = list(map(Candidate, planned, fqns, modules, request_of, specs, map(labels.__getitem__, request_of)))
    if family_specs:
        for candidate in candidates:
            if candidate.request == FAMILY:
                candidate.spec = family_specs[module_classes[candidate.index]]
                candidate.source = f"family {type(candidate.module).__qualname__}"
    return candidates


def by_index(candidates: Sequence[Candidate], values: Mapping[int, list[int]]) -> list[tuple[Candidate, list[int]]]:
    """The candidates whose module index ``values`` has, with its value."""
    return [(candidate, values[candidate.index]) for candidate in candidates if candidate.index in values]
