"""Pipeline ranks' step memory put together from a traced rank's step, action by action, under
torch's runtime (every multi-stage schedule) and under 1F1B's own loop (a rank from its own trace).

A traced rank's step is cut at each step torch's runtime takes, or where each action of 1F1B's loop
starts (``PipelinedMemoryWatch.parts``). A
rank whose every action has a twin on a traced rank holding the same stages' modules
(``pipeline/runtime.py``) allocates and frees in each action what its twin does: every tensor a
stage frees is freed by reference counting where it is let go of (``memory/trackers.py``), so what
an action frees is its own microbatch's, made by that microbatch's own earlier actions. Its step
is the traced rank's until the runtime's first step (the same stages' state), then each of its
actions in its own order: the bytes its twin held above those it began with at its highest, and
its twin's change to them; then what follows the schedule, as on the traced rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from meshbind.memory.pipelined import action_text, stage_actions
from meshbind.memory.trackers import Peak, StepPart
from meshbind.pipeline.stages import PipelineStages


def put_together(
    parts: Sequence[StepPart], taken: Sequence[int], actions: Sequence[Any], moved: Callable[[str], str], more_inputs: int
) -> Peak:
    """The peak of a rank whose runtime list is ``actions``, from a traced rank's ``parts``: the
    ``i``-th of ``actions`` is the twin of the traced rank's runtime step ``taken[i]``; ``moved``
    names a module of the traced rank's stages as the module in the same place of this rank's;
    ``more_inputs``: the bytes of inputs this rank holds through its step beyond the traced one's."""
    before, steps, after = parts[0], parts[1:-1], parts[-1]
    highest = _with_inputs(before.highest, more_inputs)
    peak = Peak(highest["peak"], _kinds(highest), moved(before.module), before.phase, {}, before.action)
    running = _with_inputs(before.end, more_inputs)
    numbered, last = 0, before.action
    for step, action in zip(taken, actions, strict=True):
        part = steps[step]
        runs = stage_actions(action)
        begun = part.actions_begun
        at_highest = action_text(numbered + begun, *_stage_kind(runs[begun - 1])) if begun else last
        peak = _higher(peak, _moved_by(running, part.begin, part.highest), moved(part.module), part.phase, at_highest)
        running = _moved_by(running, part.begin, part.end)
        if runs:
            numbered += len(runs)
            last = action_text(numbered, *_stage_kind(runs[-1]))
    return _higher(peak, _moved_by(running, after.begin, after.highest), moved(after.module), after.phase, after.action)


def _stage_kind(run: tuple[str, int, int]) -> tuple[int, str, int]:
    kind, stage, microbatch = run
    return stage, kind, microbatch


def _with_inputs(figures: dict[str, int], more: int) -> dict[str, int]:
    return {**figures, "inputs": figures["inputs"] + more, "peak": figures["peak"] + more}


def _moved_by(running: dict[str, int], begin: dict[str, int], then: dict[str, int]) -> dict[str, int]:
    """``running`` changed by what changed from ``begin`` to ``then``, kind by kind."""
    return {kind: running[kind] + then[kind] - begin[kind] for kind in running}


def _higher(peak: Peak, figures: dict[str, int], module: str, phase: str, action: str) -> Peak:
    """``peak``, or the moment of ``figures`` where it holds more (the first highest stands, as a trace keeps it)."""
    if figures["peak"] <= peak.total:
        return peak
    return Peak(figures["peak"], _kinds(figures), module, phase, {}, action)


def _kinds(figures: dict[str, int]) -> dict[str, int]:
    return {kind: size for kind, size in figures.items() if kind != "peak"}


def module_mover(stages: PipelineStages, theirs: Sequence[int], mine: Sequence[int]) -> Callable[[str], str]:
    """Names a module of the stages ``theirs`` as the module in the same place of ``mine``, stage
    by stage (alike stages: the same modules under each root); a name in none of them stays."""
    roots = {
        root: own
        for stage, own_stage in zip(theirs, mine, strict=True)
        for root, own in zip(stages.stages[stage], stages.stages[own_stage], strict=True)
    }

    def moved(fqn: str) -> str:
        path = fqn
        while path:
            if path in roots:
                return roots[path] + fqn[len(path) :]
            path = path.rpartition(".")[0]
        return fqn

    return moved
