"""The ``nested`` problem: a bound module inside another bound module of the same binding kind.

A module is nested when one of its FQNs (aliases included: a shared module sits in each place)
lies below an FQN of another bound module of the same kind. The FQNs come in preorder, so each
kind's open ancestors form a stack.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshbind._core import ModuleTree
from meshbind.errors import PlanProblem, ProblemCode
from meshbind.resolution.candidates import Candidate


def nested_problems(candidates: Sequence[Candidate], tree: ModuleTree) -> list[PlanProblem]:
    bound = [candidate for candidate in candidates if candidate.spec.binding_kind != "none"]
    if not bound:
        return []
    names: list[tuple[str, Candidate]]
    if tree.complete and len(tree) > tree.module_count:  # the tree has aliases
        of_module = {candidate.index: candidate for candidate in bound}
        named = zip(tree.names(), map(of_module.get, tree.name_modules()), strict=True)
        names = [(name, candidate) for name, candidate in named if candidate is not None]
    else:
        names = [(candidate.fqn, candidate) for candidate in bound]  # in tree order
    outer_of: dict[int, Candidate] = {}
    inner: dict[int, Candidate] = {}
    open_by_kind: dict[str, list[tuple[str, Candidate]]] = {}
    for name, candidate in names:
        stack = open_by_kind.setdefault(candidate.spec.binding_kind, [])
        while stack and not (stack[-1][0] == "" or name.startswith(stack[-1][0] + ".")):
            stack.pop()
        if candidate.index not in outer_of:
            outer = next((other for _, other in reversed(stack) if other is not candidate), None)
            if outer is not None:
                outer_of[candidate.index], inner[candidate.index] = outer, candidate
        stack.append((name, candidate))
    problems = []
    for index, outer in outer_of.items():
        kind = inner[index].spec.binding_kind
        message = f"a {kind!r} module inside the {kind!r} module {outer.fqn!r}"
        problems.append(PlanProblem(ProblemCode.NESTED, inner[index].fqn, None, message))
    return problems
