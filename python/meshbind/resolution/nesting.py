"""The ``nested`` problem: a bound module inside another bound module of the same binding kind.

A module is nested when one of its FQNs (aliases included: a shared module sits in each place)
lies below an FQN of another bound module of the same kind. The FQNs come in preorder, so each
kind's open ancestors form a stack.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshbind._core import ModuleTree
from meshbind.errors import PlanProblem, ProblemCode
from meshbind.resolution.selection import ModuleRecord


def nested_problems(records: Sequence[ModuleRecord], tree: ModuleTree) -> list[PlanProblem]:
    bound = [record for record in records if record.spec.binding_kind != "none"]
    if not bound:
        return []
    names: list[tuple[str, ModuleRecord]]
    if tree.complete and len(tree) > tree.module_count:  # the tree has aliases
        of_module = {record.index: record for record in bound}
        named = zip(tree.names(), map(of_module.get, tree.name_modules()), strict=True)
        names = [(name, record) for name, record in named if record is not None]
    else:
        names = [(record.fqn, record) for record in bound]  # in tree order
    outer_of: dict[int, ModuleRecord] = {}
    inner: dict[int, ModuleRecord] = {}
    open_by_kind: dict[str, list[tuple[str, ModuleRecord]]] = {}
    for name, record in names:
        stack = open_by_kind.setdefault(record.spec.binding_kind, [])
        while stack and not (stack[-1][0] == "" or name.startswith(stack[-1][0] + ".")):
            stack.pop()
        if record.index not in outer_of:
            outer = next((other for _, other in reversed(stack) if other is not record), None)
            if outer is not None:
                outer_of[record.index], inner[record.index] = outer, record
        stack.append((name, record))
    problems = []
    for index, outer in outer_of.items():
        kind = inner[index].spec.binding_kind
        message = f"a {kind!r} module inside the {kind!r} module {outer.fqn!r}"
        problems.append(PlanProblem(ProblemCode.NESTED, inner[index].fqn, None, message))
    return problems
