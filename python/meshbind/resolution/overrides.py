"""Overrides: partial sharding specs merged field by field over the providers' output.

An override pattern selects planned modules only; a field it sets wins, the others keep the
derived value, and several overrides selecting one module merge in the mapping's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from meshbind.errors import PlanProblem, ProblemCode
from meshbind.resolution.selection import Override, PlannedModules
from meshbind.specs import SHARDING_FIELDS, ModuleShardingSpec


def checked_overrides(overrides: object) -> list[Override]:
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must map patterns to sharding fields, got {type(overrides).__name__}")
    for pattern, fields in overrides.items():
        if not isinstance(pattern, str) or not isinstance(fields, Mapping):
            raise TypeError(f"overrides[{pattern!r}] must map a pattern str to a mapping of sharding fields")
    return list(overrides.items())


def override_label(overrides: Sequence[Override], index: int) -> str:
    return f"overrides[{overrides[index][0]!r}]"


def merge_overrides(planned: PlannedModules, overrides: Sequence[Override]) -> list[PlanProblem]:
    """Merges each module's overrides into its sharding; a failed merge leaves it ``None``."""
    problems: list[PlanProblem] = []
    for index, selecting in planned.overrides.items():
        row = planned.row(index)
        sharding = planned.shardings[row]
        if sharding is not None:
            planned.shardings[row] = _merged(sharding, planned.fqns[row], [overrides[i] for i in selecting], problems)
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


def reported_source(planned: PlannedModules, row: int, overrides: Sequence[Override]) -> str:
    """What a module's problems name: its source, and every override merged into its sharding."""
    merged = planned.overrides.get(planned.indices[row])
    if not merged:
        return planned.sources[row]
    return ", ".join([planned.sources[row], *(override_label(overrides, index) for index in merged)])
