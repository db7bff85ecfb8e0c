"""Who owns each selected module (the ``conflict`` problem): the request that selects it first, a
second request with a different spec (a conflict), or the module's own class (a family member).

Two requests with equal specs may share a module; whether their layouts agree is for the
providers to say (``providers.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshbind._core import ModuleTree
from meshbind.errors import PlanProblem, ProblemCode
from meshbind.family import family_spec
from meshbind.resolution.candidates import FAMILY, PlanPatterns
from meshbind.specs import NativeParallelBindingRequest, ParallelModuleSpec


@dataclass
class Ownership:
    """The selected modules in tree order, the request of each, and the problems found."""

    planned: list[int]
    request_of: list[int]
    sharing: dict[int, list[int]] = field(default_factory=dict)
    """Module → the other requests (with its first request's spec) that select it too."""
    problems: list[PlanProblem] = field(default_factory=list)


def assign_requests(tree: ModuleTree, patterns: PlanPatterns, requests: Sequence[NativeParallelBindingRequest]) -> Ownership:
    """Each selected module's first request; a module a second request with a different spec
    selects is a conflict and leaves the plan, one with an equal spec is kept in ``sharing``."""
    request_of_pattern = [owner if owner >= 0 else None for owner in patterns.owners]
    planned, request_of, others = tree.owners(request_of_pattern)
    ownership = Ownership(planned, request_of)
    if not others:
        return ownership
    first = dict(zip(planned, request_of, strict=True))
    specs = [request.parallel for request in requests]
    conflicts = sorted({(m, first[m], r) for m, r in others if specs[first[m]] is not specs[r] and specs[first[m]] != specs[r]})
    for module, first_request, second in conflicts:
        fqn = tree.module_fqns([module])[0]
        a, b = specs[first_request], specs[second]
        message = (
            f"selected by requests[{first_request}] ({a.describe()}) and requests[{second}] ({b.describe()}) with different specs"
        )
        ownership.problems.append(
            PlanProblem(ProblemCode.CONFLICT, fqn, f"requests[{first_request}], requests[{second}]", message)
        )
    dropped = {module for module, _, _ in conflicts}
    for module, second in sorted(others):
        if module not in dropped:
            ownership.sharing.setdefault(module, []).append(second)
    if dropped:
        kept = [row for row, module in enumerate(planned) if module not in dropped]
        ownership.planned, ownership.request_of = [planned[row] for row in kept], [request_of[row] for row in kept]
    return ownership


def family_specs(classes: Sequence[type]) -> tuple[dict[int, ParallelModuleSpec], list[PlanProblem]]:
    """The ``parallel_spec`` of every family class the walk met, by class index; a class whose
    ``parallel_spec`` is no ``ParallelModuleSpec`` is a problem."""
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


def join_families(
    ownership: Ownership,
    tree: ModuleTree,
    requests: Sequence[NativeParallelBindingRequest],
    specs: dict[int, ParallelModuleSpec],
    classes: Sequence[type],
    module_classes: Sequence[int],
) -> None:
    """Family members join the plan; a request giving one a different spec is a conflict."""
    owner = dict(zip(ownership.planned, ownership.request_of, strict=True))
    for module in tree.modules_of_classes(list(specs)):
        spec = specs[module_classes[module]]
        request = owner.get(module)
        if request is None:
            owner[module] = FAMILY
        elif requests[request].parallel != spec:
            cls = classes[module_classes[module]]
            given = requests[request].parallel.describe()
            message = f"requests[{request}] gives it {given}, but its class {cls.__qualname__} owns {spec.describe()}"
            fqn = tree.module_fqns([module])[0]
            ownership.problems.append(
                PlanProblem(ProblemCode.CONFLICT, fqn, f"requests[{request}], family {cls.__qualname__}", message)
            )
            del owner[module]
    ownership.planned = sorted(owner)
    ownership.request_of = list(map(owner.__getitem__, ownership.planned))
