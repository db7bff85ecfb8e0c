"""Pipeline ranks put together from other ranks' traces, action by action, under the schedules
torch runs from a list of every rank's actions (its runtime: every multi-stage schedule).

A traced rank's timeline is cut at each action torch's runtime takes (under a single-stage
schedule, at each action's start). A rank whose every action has a twin on one traced rank holding
the same stages' modules (``pipeline/runtime.py``) is that rank's actions in its own order,
renumbered: its stages, microbatches and groups' ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshbind.comms.timeline import Compute, CutTimeline, Event, Mark, Timeline, Transfer
from meshbind.pipeline.hooks import on_each_runtime_step
from meshbind.pipeline.runtime import Orders, RankActions, action_parts
from meshbind.pipeline.schedules import RELEASE, STAGE_ACTIONS
from meshbind.world import PIPELINE_AXIS

RUNTIME_STEP = "runtime step"
"""The mark of each action torch's runtime takes from the rank's list, its place in the list as
the microbatch."""


def marked_runtime_steps(schedule: object, timeline: Timeline) -> Orders | None:
    """Every rank's list of actions under torch's runtime, the schedule's own rank's marked on
    ``timeline`` as each is taken; ``None`` for a single-stage schedule, which has no such list."""
    return on_each_runtime_step(schedule, lambda position: timeline.mark(RUNTIME_STEP, -1, position))


@dataclass(frozen=True)
class TracedRank:
    """A pipeline rank's traced timeline cut at its runtime actions."""

    pp_rank: int
    steps: CutTimeline
    """Cut at each runtime step: its ``parts`` are each action's events, its mark first."""

    @staticmethod
    def cut(pp_rank: int, timeline: Timeline, actions: RankActions) -> TracedRank:
        return TracedRank(pp_rank, timeline.cut((*STAGE_ACTIONS, RELEASE) if actions.single_stage else (RUNTIME_STEP,)))


def put_together(rank: int, source: TracedRank, taken: list[int], actions: RankActions, stage_size: int) -> Timeline:
    """Pipeline rank ``rank``'s timeline from ``source``'s steps at ``taken`` (``RankActions.twin_positions``):
    its actions in its own order, their stages, microbatches, groups' ranks and all-gathers' numbers its own."""
    stage_of = dict(zip(actions.stages.stages_of_rank(source.pp_rank), actions.stages.stages_of_rank(rank), strict=True))
    further = (rank - source.pp_rank) * stage_size
    gathers: dict[int, int] = {}
    events: list[Event] = []

    def add(event: Event, microbatches: list[int] | None = None) -> None:
        if isinstance(event, Mark) and event.what in (*STAGE_ACTIONS, RELEASE) and microbatches is not None:
            event = replace(event, stage=stage_of[event.stage], microbatch=microbatches.pop(0))
        elif isinstance(event, Transfer):
            if PIPELINE_AXIS not in event.axes:  # a group along pp is the same one
                event = replace(event, lowest_rank=event.lowest_rank + further, highest_rank=event.highest_rank + further)
            if event.gather >= 0:
                gathers[event.gather] = len(gathers) + 1
                event = replace(event, gather=gathers[event.gather])
        elif isinstance(event, Compute) and event.waits_for >= 0:
            event = replace(event, waits_for=gathers.get(event.waits_for, -1))
        events.append(event)

    for event in source.steps.before:
        add(event)
    for position, (step, action) in enumerate(zip(taken, actions.orders[rank], strict=True)):
        microbatches = [microbatch for _, _, microbatch in action_parts(action)]
        first, *rest = source.steps.parts[step]
        if isinstance(first, Mark) and first.what == RUNTIME_STEP:
            add(replace(first, microbatch=position))
        else:  # a single-stage schedule's part begins at its action's own mark
            rest = [first, *rest]
        for event in rest:
            add(event, microbatches)
    for event in source.steps.after:
        add(event)
    return Timeline(events)
