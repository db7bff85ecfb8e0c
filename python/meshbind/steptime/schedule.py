"""A pipeline's schedule in time: every pipeline rank runs torch's own order of its actions
(``run_order``), each action as soon as its rank is free and its input has arrived: a
forward once the stage before has run that microbatch forward and sent its output, a backward
once the stage after has run that microbatch backward and sent the gradient. What a rank waits
beyond its own work is its bubble."""

from __future__ import annotations

from collections.abc import Callable

from meshbind.pipeline.schedules import ActionKey
from meshbind.pipeline.stages import PipelineStages


def scheduled_ends(
    stages: PipelineStages, pp: int, seconds: Callable[[ActionKey], float], hop: Callable[[int], float]
) -> list[float]:
    """When each pipeline rank's last action ends, starting together: ``seconds(action)`` is an
    action's own time, ``hop(stage)`` what a send from ``stage`` takes."""
    count = len(stages.stages)
    order = stages.order
    done: dict[ActionKey, float] = {}
    free = [0.0] * pp
    position = [0] * pp
    while any(position[rank] < len(order[rank]) for rank in range(pp)):
        moved = False
        for rank in range(pp):
            while position[rank] < len(order[rank]):
                parts = order[rank][position[rank]]
                ready = [_input_ready(part, count, done, hop) for part in parts]
                if any(time is None for time in ready):
                    break
                end = max([free[rank], *(time for time in ready if time is not None)])
                for part in parts:
                    end += seconds(part)
                    done[part] = end
                free[rank] = end
                position[rank] += 1
                moved = True
        if not moved:
            stuck = {rank: order[rank][position[rank]] for rank in range(pp) if position[rank] < len(order[rank])}
            raise AssertionError(f"{stages.schedule.name}'s actions wait on each other: {stuck}")
    return free


def _input_ready(part: ActionKey, stages: int, done: dict[ActionKey, float], hop: Callable[[int], float]) -> float | None:
    """When ``part``'s input has arrived (0 for one made on its own rank's earlier actions), or
    ``None`` while it has not been sent."""
    kind, stage, microbatch = part
    if kind == "F" and stage > 0:
        sent = done.get(("F", stage - 1, microbatch))
        return None if sent is None else sent + hop(stage - 1)
    if kind in ("B", "I") and stage < stages - 1:
        sent = done.get(("B", stage + 1, microbatch), done.get(("I", stage + 1, microbatch)))
        return None if sent is None else sent + hop(stage + 1)
    return 0.0
