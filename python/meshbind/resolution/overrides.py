"""Overrides: partial sharding specs merged field by field over the providers' output.

An override pattern selects planned modules only; a field it sets wins, the others keep the
derived value, and several overrides selecting one module merge in the mapping's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from meshbind._core import ModuleTree
from meshbind.errors import PlanProblem, ProblemCode
from meshbind.resolution.candidates import Candidate, PlanPatterns
from meshbind.specs import SHARDING_FIELDS, ModuleShardingSpec

Override = tuple[str, Mapping[str, Any]]
"""``(pattern, sharding fields)``."""


def checked_overrides(overrides: object) -> list[Override]:
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must map patterns to sharding fields, got {type(overrides).__name__}")
    for pattern, fields in overrides.items():
        if not isinstance(pattern, str) or not isinstance(fields, Mapping):
            raise TypeError(f"overrides[{pattern!r}] must map a pattern str to a mapping of sharding fields")
    return list(overrides.items())


def override_hits(tree: ModuleTree, patterns: PlanPatterns) -> dict[int, list[int]]:
    """Module index → the overrides selecting it, ascending."""
    override_of = [-1 - owner if owner < 0 else None for owner in patterns.owners]
    if all(owner is None for owner in override_of):
        return {}
    modules, first_override, more = tree.owners(override_of)
    hits = {module: [index] for module, index in zip(modules, first_override, strict=True)}
    for module, index in more:
        hits[module].append(index)
    for indices in hits.values():
        indices.sort()
    return hits


def override_label(overrides: Sequence[Override], index: int) -> str:
    return f"overrides[{overrides[index][0]!r}]"


def merge_overrides(candidates: Sequence[Candidate], overrides: Sequence[Override]) -> list[PlanProblem]:
    """Merges each candidate's overrides into its sharding; a failed merge leaves it ``None``."""
    problems: list[PlanProblem] = []
    for candidate in candidates:
        if candidate.overrides and candidate.sharding is not None:
            candidate.sharding = _merged(candidate.sharding, candidate.fqn, [overrides[i] for i in candidate.overrides], problems)
    return problems


def _merged(
    sharding: ModuleShardingSpec, fqn: str, overrides: Sequence[Override], problems: list[PlanProblem]
) -> ModuleShardingSpec | None:
    for pattern, fields in overrides:
        unknown = sorted(set(fields) - set(SHARDING_FIELDS))
        try:
            if unknown:
                raise ValueError(f"unknown sharding fields {unknown} (an override may set {list(SHARDING_FIELDS)})")
            sharding = dataclasses.replace(sharding, **fields)
        except (TypeError, ValueError) as error:
            problems.append(PlanProblem(ProblemCode.LAYOUT, fqn, f"overrides[{pattern!r}]", f"the override failed: {error}"))
            return None
    return sharding
