"""A pipeline's schedule in time: every pipeline rank runs torch's own order of its actions
(``schedule_actions``), each action as soon as its rank is free and its input has arrived: a
forward once the stage before has run that microbatch forward and sent its output, a backward
once the stage after has run that microbatch backward and sent the gradient. What a rank waits
beyond its own work is its bubble."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshbind.comms.timeline import ACTIONS
from meshbind.pipeline.schedules import schedule_actions
from meshbind.pipeline.stages import PipelineStages

ActionKey = tuple[str, int, int]
"""An action as torch names it: kind (``F``, ``B``, ``I``, ``W``), stage, microbatch."""


def scheduled_ends(
    stages: PipelineStages, pp: int, seconds: Callable[[ActionKey], float], hop: Callable[[int], float]
) -> list[float]:
    """When each pipeline rank's last action ends, starting together: ``seconds(action)`` is an
    action's own time, ``hop(stage)`` what a send from ``stage`` takes."""
    count = len(stages.stages)
    order = rank_orders(stages, pp)
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


def rank_orders(stages: PipelineStages, pp: int) -> list[list[list[ActionKey]]]:
    """Each pipeline rank's actions in the order torch runs them, each as the stage actions it runs
    (DualPipeV's overlapped forward and backward as both). A multi-stage schedule runs its
    ``pipeline_order``; torch's single-stage 1F1B runs its own loop (``Schedule1F1B._step_microbatches``:
    ``min(m, p - r)`` forwards, then a backward and a forward in turn, then the backwards left),
    which its ``pipeline_order`` (drawn for pictures) gives otherwise on the last rank."""
    m = stages.microbatches
    if stages.schedule.name == "1F1B":
        orders = []
        for rank in range(pp):
            warmup = min(m, pp - rank)
            order = [("F", rank, mb) for mb in range(warmup)]
            for mb in range(m):
                order.append(("B", rank, mb))
                if warmup + mb < m:
                    order.append(("F", rank, warmup + mb))
            orders.append([[action] for action in order])
        return orders
    ranks = schedule_actions(stages.schedule, pp, len(stages.stages), m)
    return [[parts for action in rank if (parts := _parts(action))] for rank in ranks]


def _parts(action: Any) -> list[ActionKey]:
    """The stage actions an action runs; none for FSDP's and the sends' own, which the traced
    actions already hold."""
    actions = action.sub_actions if action.sub_actions is not None else (action,)
    found = [(str(part.computation_type.value), part.stage_index, part.microbatch_index) for part in actions]
    return [part for part in found if part[0] in ACTIONS]


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
