"""Validation of the laid-out records: every per-module rule of ``meshbind.validation``, run once
over all of them, each problem naming the module's source and the overrides merged into it."""

from __future__ import annotations

from collections.abc import Sequence

from meshbind.errors import PlanProblem
from meshbind.resolution.selection import ModuleRecord, Override
from meshbind.resolution.unmatched import reported_source
from meshbind.specs import LayoutContext, ModuleShardingSpec
from meshbind.validation.batch import ValidationBatch


def validation_problems(
    records: Sequence[ModuleRecord],
    context: LayoutContext,
    shapes: dict[str, tuple[int, ...]] | None,
    overrides: Sequence[Override],
    offline: bool,
) -> list[PlanProblem]:
    """The problems of the records with a layout (the others' problems are reported)."""
    fqns = [record.fqn for record in records]
    shardings: list[ModuleShardingSpec] = [record.sharding for record in records]  # type: ignore[misc]
    found = ValidationBatch(context, shapes).check(
        [record.module for record in records],
        fqns,
        [record.spec for record in records],
        shardings,
        None if offline else [record.cls for record in records],  # type: ignore[misc]
    )
    return [PlanProblem(code, fqns[row], reported_source(records[row], overrides), message) for row, code, message in found]
