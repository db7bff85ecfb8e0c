"""Family members join the plan. A module whose class declares ``parallel_spec``
is planned with that spec without a request; a request giving it another spec is a conflict.
"""

from __future__ import annotations

from typing import cast

from torch import nn

from meshbind.errors import PlanProblem, ProblemCode
from meshbind.family import family_spec
from meshbind.resolution.selection import PlannedRow, Selection
from meshbind.specs import ParallelModuleSpec


def join_families(selection: Selection) -> tuple[set[int], list[PlanProblem]]:
    """Adds every family member the walk met to the planned modules, in tree order; returns the
    members' module indices and the problems: a conflicting request, or a class whose
    ``parallel_spec`` is no ``ParallelModuleSpec``."""
    if selection.offline:
        return set(), []
    tree, planned = selection.tree, selection.planned
    classes = tree.classes()
    specs, problems = _family_specs(classes)
    if not specs:
        return set(), problems
    members = tree.modules_of_classes(list(specs))
    module_classes = tree.module_classes()
    rows = {row.tree_index: row for row in planned.rows()}
    joining = [member for member in members if member not in rows]
    for member, fqn, module in zip(joining, tree.module_fqns(joining), tree.modules(joining), strict=True):
        cls, spec = classes[module_classes[member]], specs[module_classes[member]]
        rows[member] = PlannedRow(member, fqn, cast(nn.Module, module), cls, None, spec, f"family {cls.__qualname__}", None)
        if member in selection.override_only:
            planned.overrides[member] = selection.override_only[member]
    conflicted: set[int] = set()
    for member in members:
        row, spec = rows[member], specs[module_classes[member]]
        if row.request is not None and row.spec != spec:
            owner = cast(type, row.cls).__qualname__
            message = f"requests[{row.request}] gives it {row.spec.describe()}, but its class {owner} owns {spec.describe()}"
            problems.append(PlanProblem(ProblemCode.CONFLICT, row.fqn, f"requests[{row.request}], family {owner}", message))
            conflicted.add(member)
    planned.set_rows([rows[index] for index in sorted(rows) if index not in conflicted])
    return set(members), problems


def _family_specs(classes: list[type]) -> tuple[dict[int, ParallelModuleSpec], list[PlanProblem]]:
    """The ``parallel_spec`` of every family class the walk met, by class index."""
    specs: dict[int, ParallelModuleSpec] = {}
    problems = []
    for index, cls in enumerate(classes):
        spec = family_spec(cls)
        if spec is None:
            continue
        if not isinstance(spec, ParallelModuleSpec):
            message = f"{cls.__qualname__}.parallel_spec must be a ParallelModuleSpec, got {type(spec).__name__}"
            problems.append(PlanProblem(ProblemCode.BINDING, None, f"family {cls.__qualname__}", message, about="class"))
            continue
        specs[index] = spec
    return specs, problems
