"""Validation of the laid-out records: every per-module rule of ``meshbind.validation``, run once
over all of them, each problem naming the module's source and the overrides merged into it."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from meshbind.errors import PlanProblem
from meshbind.resolution.overrides import reported_source
from meshbind.resolution.selection import ModuleRecord, Override
from meshbind.specs import LayoutContext
from meshbind.validation.batch import ValidationBatch

_READ = ("fqn", "module", "spec", "sharding", "cls")
"""What the rules read of each record."""


def validation_problems(
    records: Sequence[ModuleRecord],
    context: LayoutContext,
    shapes: dict[str, tuple[int, ...]] | None,
    overrides: Sequence[Override],
    offline: bool,
) -> list[PlanProblem]:
    """The problems of the records with a layout (the others' problems are reported)."""
    fqns, modules, specs, shardings, classes = (list(map(attrgetter(field), records)) for field in _READ)
    found = ValidationBatch(context, shapes).check(modules, fqns, specs, shardings, None if offline else classes)
    return [PlanProblem(code, fqns[row], reported_source(records[row], overrides), message) for row, code, message in found]
