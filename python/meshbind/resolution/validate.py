"""Validation of the laid-out modules: every per-module rule of ``meshbind.validation``, run once
over all of them, each problem naming the module's source and the overrides merged into it."""

from __future__ import annotations

from collections.abc import Sequence

from meshbind.errors import PlanProblem
from meshbind.resolution.overrides import reported_source
from meshbind.resolution.selection import Override, PlannedModules
from meshbind.specs import LayoutContext
from meshbind.validation.batch import ValidationBatch


def validation_problems(
    laid_out: PlannedModules,
    context: LayoutContext,
    shapes: dict[str, tuple[int, ...]] | None,
    overrides: Sequence[Override],
    offline: bool,
) -> list[PlanProblem]:
    """The problems of the modules with a layout (the others' problems are reported)."""
    classes = None if offline else laid_out.classes
    found = ValidationBatch(context, shapes).check(laid_out.modules, laid_out.fqns, laid_out.specs, laid_out.shardings, classes)  # type: ignore[arg-type]
    return [
        PlanProblem(code, laid_out.fqns[row], reported_source(laid_out, row, overrides), message) for row, code, message in found
    ]
