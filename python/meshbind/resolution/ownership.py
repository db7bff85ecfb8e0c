"""Who owns each selected module (the ``conflict`` problem): the request that
selects it first, or a second request with a different spec (a conflict: the module leaves the
plan).

Two requests with equal specs may share a module; whether their layouts agree is for the
providers to say (``providers.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from meshbind.errors import PlanProblem, ProblemCode
from meshbind.resolution.selection import ModuleRecord
from meshbind.specs import NativeParallelBindingRequest


def own_modules(
    records: list[ModuleRecord], requests: Sequence[NativeParallelBindingRequest]
) -> tuple[list[ModuleRecord], list[PlanProblem]]:
    """The records kept and the conflicts: a module that a second request with a different spec
    selects leaves the plan; a kept record's ``other_requests`` all have its spec."""
    problems: list[PlanProblem] = []
    conflicted: set[int] = set()
    for record in records:
        if not record.other_requests:
            continue
        spec = record.spec
        differing = [
            other for other in record.other_requests if requests[other].parallel is not spec and requests[other].parallel != spec
        ]
        for other in differing:
            message = (
                f"selected by requests[{record.request}] ({spec.describe()}) and requests[{other}] "
                f"({requests[other].parallel.describe()}) with different specs"
            )
            problems.append(
                PlanProblem(ProblemCode.CONFLICT, record.fqn, f"requests[{record.request}], requests[{other}]", message)
            )
        if differing:
            conflicted.add(record.index)
    if not conflicted:
        return records, problems
    return [record for record in records if record.index not in conflicted], problems
