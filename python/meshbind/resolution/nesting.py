"""The ``nested`` problem: a bound module inside another bound module of the same binding kind.

A module is nested when one of its FQNs (aliases included: a shared module sits in each place)
lies below an FQN of another bound module of the same kind. The FQNs come in preorder, so each
kind's open ancestors form a stack.
"""

from __future__ import annotations

from meshbind._core import ModuleTree
from meshbind.errors import PlanProblem, ProblemCode
from meshbind.resolution.selection import PlannedModules


def nested_problems(planned: PlannedModules, tree: ModuleTree) -> list[PlanProblem]:
    kinds = [spec.binding_kind for spec in planned.specs]
    bound = [row for row, kind in enumerate(kinds) if kind != "none"]
    if not bound:
        return []
    names: list[tuple[str, int]]
    if tree.complete and len(tree) > tree.module_count:  # the tree has aliases
        row_of = {planned.indices[row]: row for row in bound}
        named = zip(tree.names(), map(row_of.get, tree.name_modules()), strict=True)
        names = [(name, row) for name, row in named if row is not None]
    else:
        names = [(planned.fqns[row], row) for row in bound]  # in tree order
    outer_of: dict[int, int] = {}
    open_by_kind: dict[str, list[tuple[str, int]]] = {}
    for name, row in names:
        stack = open_by_kind.setdefault(kinds[row], [])
        while stack and not (stack[-1][0] == "" or name.startswith(stack[-1][0] + ".")):
            stack.pop()
        if stack and row not in outer_of:  # an open module of its kind is above it
            outer = next((other for _, other in reversed(stack) if other != row), None)
            if outer is not None:
                outer_of[row] = outer
        stack.append((name, row))
    problems = []
    for row, outer in outer_of.items():
        message = f"a {kinds[row]!r} module inside the {kinds[row]!r} module {planned.fqns[outer]!r}"
        problems.append(PlanProblem(ProblemCode.NESTED, planned.fqns[row], None, message))
    return problems
