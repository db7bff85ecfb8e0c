"""The ``unmatched`` problem: a pattern that selects nothing, with "did you mean" among the names it
could have meant.

A request's pattern is suggested the model's FQNs; an override's, the planned modules' FQNs (the
only ones it may select). An optional request's pattern that selects nothing is a warning of the
plan, not a problem.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from meshbind._core import ModuleTree, PatternSet
from meshbind.errors import PlanProblem, ProblemCode, did_you_mean
from meshbind.model_index import ModelIndex
from meshbind.resolution.selection import Selection


def unmatched_problems(
    selection: Selection, model: nn.Module | Sequence[str], model_index: ModelIndex | None
) -> tuple[list[PlanProblem], list[PlanProblem]]:
    """The unmatched problems, and the warnings of optional requests' patterns that select nothing;
    "did you mean" reads the model index when there is one."""
    counts = selection.tree.hit_counts()
    overrides_used = {index for found in selection.planned.overrides.values() for index in found}
    every_name: ModelNames | None = None
    planned_names: ModuleTree | None = None
    problems: list[PlanProblem] = []
    warnings: list[PlanProblem] = []
    for index, (pattern, request, override) in enumerate(selection.patterns.owned()):
        if request is not None and counts[index] == 0:
            if every_name is None:
                every_name = ModelNames.of(model_index or model)
            nearest, source, what = every_name.nearest(pattern), f"requests[{request}]", "any module"
        elif override is not None and override not in overrides_used:
            if planned_names is None:
                planned_names = PatternSet([]).index_names(selection.planned.fqns, prune=False)
            nearest = [repr(name) for name in planned_names.nearest(pattern, 3)]
            source, what = f"overrides[{pattern!r}]", "any planned module"
        else:
            continue
        hint = did_you_mean(nearest)
        found = PlanProblem(
            ProblemCode.UNMATCHED, None, source, f"pattern {pattern!r} does not select {what}{hint}", about="pattern"
        )
        (warnings if request is not None and not selection.requests[request].required else problems).append(found)
    return problems, warnings


class ModelNames:
    """Every FQN of the model for "did you mean": its modules' and, for a module tree, its
    parameters' (a parameter FQN written where a module is meant is a common slip), one index."""

    def __init__(self, index: ModuleTree, parameters: frozenset[str]) -> None:
        self.index, self.parameters = index, parameters

    @staticmethod
    def of(model: nn.Module | Sequence[str] | ModelIndex) -> ModelNames:
        every = PatternSet([])
        if isinstance(model, ModelIndex):
            parameters = [*model.parameter_fqns, *model.ties]
            return ModelNames(every.index_names([*model.names, *parameters], prune=False), frozenset(parameters))
        if not isinstance(model, nn.Module):
            return ModelNames(every.index_names(model, prune=False), frozenset())
        tree = every.walk(model, prune=False, parameters=True)
        parameters = tree.parameter_names()
        return ModelNames(every.index_names([*tree.names(), *parameters], prune=False), frozenset(parameters))

    def nearest(self, pattern: str) -> list[str]:
        """Up to three, each quoted; a parameter says so, and which module holds it."""
        return [
            f"{name!r} (a parameter of {name.rpartition('.')[0]!r})" if name in self.parameters else repr(name)
            for name in self.index.nearest(pattern, 3)
        ]
