"""Family members join the plan. A module whose class declares ``parallel_spec``
is planned with that spec without a request; a request giving it another spec is a conflict.
"""

from __future__ import annotations

from meshbind.errors import PlanProblem, ProblemCode
from meshbind.family import family_spec
from meshbind.resolution.selection import ModuleRecord, Selection
from meshbind.specs import ParallelModuleSpec


def join_families(records: list[ModuleRecord], selection: Selection) -> tuple[list[ModuleRecord], set[int], list[PlanProblem]]:
    """The records with every family member the walk met, in tree order; the members' module
    indices; the problems: a conflicting request, or a class whose ``parallel_spec`` is no
    ``ParallelModuleSpec``."""
    if selection.offline:
        return records, set(), []
    tree = selection.tree
    classes = tree.classes()
    specs, problems = _family_specs(classes)
    if not specs:
        return records, set(), problems
    members = tree.modules_of_classes(list(specs))
    module_classes = tree.module_classes()
    planned = {record.index: record for record in records}
    joining = [member for member in members if member not in planned]
    fqns, modules = tree.module_fqns(joining), tree.modules(joining)
    for member, fqn, module in zip(joining, fqns, modules, strict=True):
        cls = classes[module_classes[member]]
        source = f"family {cls.__qualname__}"
        overrides = selection.override_only.get(member, ())
        planned[member] = ModuleRecord(member, fqn, module, cls, None, specs[module_classes[member]], source, overrides=overrides)  # type: ignore[arg-type]
    for member in members:
        record = planned[member]
        spec = specs[module_classes[member]]
        if record.request is not None and record.spec != spec:
            cls = classes[module_classes[member]]
            given = record.spec.describe()
            message = f"requests[{record.request}] gives it {given}, but its class {cls.__qualname__} owns {spec.describe()}"
            problems.append(
                PlanProblem(ProblemCode.CONFLICT, record.fqn, f"requests[{record.request}], family {cls.__qualname__}", message)
            )
            del planned[member]
    return [planned[index] for index in sorted(planned)], set(members), problems


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
