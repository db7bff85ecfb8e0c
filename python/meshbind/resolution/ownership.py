"""Who owns each selected module (the ``conflict`` problem): the request that
selects it first, or a second request with a different spec (a conflict: the module leaves the
plan).

Two requests with equal specs may share a module; whether their layouts agree is for the
providers to say (``providers.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshbind.errors import PlanProblem, ProblemCode
from meshbind.resolution.selection import PlannedModules
from meshbind.specs import NativeParallelBindingRequest


def own_modules(planned: PlannedModules, requests: Sequence[NativeParallelBindingRequest]) -> list[PlanProblem]:
    """The conflicts: a module that a second request with a different spec selects leaves the
    plan; a kept module's ``other_requests`` all have its spec."""
    problems: list[PlanProblem] = []
    conflicted: set[int] = set()
    for index, others in planned.other_requests.items():
        row = planned.row(index)
        spec, request = planned.specs[row], planned.requests[row]
        differing = [other for other in others if requests[other].parallel is not spec and requests[other].parallel != spec]
        for other in differing:
            message = (
                f"selected by requests[{request}] ({spec.describe()}) and requests[{other}] "
                f"({requests[other].parallel.describe()}) with different specs"
            )
            source = f"requests[{request}], requests[{other}]"
            problems.append(PlanProblem(ProblemCode.CONFLICT, planned.fqns[row], source, message))
        if differing:
            conflicted.add(index)
    if conflicted:
        planned.without(conflicted)
    return problems
