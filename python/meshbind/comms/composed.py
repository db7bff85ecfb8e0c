"""Pipeline ranks put together from other ranks' traces, action by action, under the schedules
torch runs from a list of every rank's actions (its runtime: every multi-stage schedule).

torch's runtime runs each rank's list of actions in order (``pipeline_order_with_comms``: forwards,
backwards, sends, receives, FSDP's unshards and reductions). A traced rank's timeline is cut at
each action it runs. Another rank's action does what a traced one did when both run the same kind
of action on a stage of the same modules at the same place of the rank (the "v" of a two-stage
schedule goes down, then up), with the same neighbours on the rank, and both are the stage's first
of that kind, its last, or neither (FSDP gathers in the first, reduces in the last). A rank whose
every action has such a traced twin on one traced rank holding the same stages' modules is that
rank's actions in its own order, renumbered: its stages, microbatches and groups' ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from meshbind.comms.timeline import SCHEDULE_END, Compute, Event, Mark, Timeline, Transfer
from meshbind.pipeline.stages import PipelineStages
from meshbind.world import PIPELINE_AXIS

RUNTIME_STEP = "runtime step"
"""The mark of each action torch's runtime takes from the rank's list, its place in the list as
the microbatch."""
Orders = dict[int, list[Any]]
"""torch's runtime lists: each pipeline rank's actions (torch's ``_Action``s)."""
ActionTwin = tuple[object, ...]


class _Marking(list[Any]):
    """A rank's list of actions that marks each as torch's runtime takes it."""

    def __init__(self, actions: list[Any], timeline: Timeline) -> None:
        super().__init__(actions)
        self._timeline = timeline

    def __iter__(self) -> Any:
        for position, action in enumerate(super().__iter__()):
            self._timeline.mark(RUNTIME_STEP, -1, position)
            yield action


def marked_runtime_steps(schedule: Any, timeline: Timeline) -> Orders | None:
    """Every rank's list of actions under torch's runtime, the schedule's own rank's marked on
    ``timeline`` as each is taken; ``None`` for a single-stage schedule, which has no such list."""
    orders = getattr(schedule, "pipeline_order_with_comms", None)
    if not orders:
        return None
    lists = {rank: list(actions) for rank, actions in orders.items()}
    orders[schedule.rank] = _Marking(orders[schedule.rank], timeline)
    return lists


@dataclass(frozen=True)
class TracedRank:
    """A pipeline rank's traced timeline cut at its runtime actions."""

    pp_rank: int
    before: tuple[Event, ...]
    steps: tuple[tuple[Event, ...], ...]
    """Each action's events, its mark first."""
    after: tuple[Event, ...]
    """From the schedule's end: the optimizer step."""

    @staticmethod
    def cut(pp_rank: int, timeline: Timeline) -> TracedRank:
        before: list[Event] = []
        steps: list[list[Event]] = []
        after: list[Event] = []
        current = before
        for event in timeline.events:
            if isinstance(event, Mark) and event.what == RUNTIME_STEP:
                steps.append([])
                current = steps[-1]
            elif isinstance(event, Mark) and event.what == SCHEDULE_END:
                current = after
            current.append(event)
        return TracedRank(pp_rank, tuple(before), tuple(map(tuple, steps)), tuple(after))


@dataclass(frozen=True)
class RankActions:
    """What tells a pipeline rank's actions apart for putting ranks together: the twin key of each
    action in its runtime list, and of the rank's stages."""

    stages: PipelineStages
    signatures: Sequence[object]
    """Each stage's modules, told apart (``pipeline.alike.stage_signatures``)."""
    orders: Orders

    def stage_twins(self, rank: int) -> tuple[object, ...]:
        mine = self.stages.stages_of_rank(rank)
        return tuple((self.signatures[stage], stage - 1 in mine, stage + 1 in mine) for stage in mine)

    def action_twins(self, rank: int) -> list[ActionTwin]:
        mine = self.stages.stages_of_rank(rank)
        runs = [_parts(action) for action in self.orders[rank]]
        total = Counter((kind, stage) for parts in runs for kind, stage, _ in parts)
        seen: Counter[tuple[str, int]] = Counter()
        twins: list[ActionTwin] = []
        for parts in runs:
            twin: list[object] = []
            for kind, stage, _ in parts:
                seen[(kind, stage)] += 1
                role = (seen[(kind, stage)] == 1, seen[(kind, stage)] == total[(kind, stage)])
                twin.append((kind, self.signatures[stage], mine.index(stage), stage - 1 in mine, stage + 1 in mine, role))
            twins.append(tuple(twin))
        return twins


def composed(rank: int, traced: Sequence[TracedRank], actions: RankActions, stage_size: int) -> tuple[Timeline, int] | None:
    """Pipeline rank ``rank``'s timeline from one of the ``traced`` ranks, and which, where one has
    a twin of each of its actions and holds the same stages' modules; else ``None``."""
    wanted = actions.action_twins(rank)
    for source in traced:
        if actions.stage_twins(source.pp_rank) != actions.stage_twins(rank):
            continue
        at: dict[ActionTwin, int] = {}
        for position, twin in enumerate(actions.action_twins(source.pp_rank)):
            at.setdefault(twin, position)
        if all(twin in at for twin in wanted):
            return _renumbered(rank, source, [at[twin] for twin in wanted], actions, stage_size), source.pp_rank
    return None


def _renumbered(rank: int, source: TracedRank, taken: list[int], actions: RankActions, stage_size: int) -> Timeline:
    """``source``'s steps at ``taken`` as ``rank``'s actions: stages, microbatches, groups' ranks
    and all-gathers' numbers its own."""
    stage_of = dict(zip(actions.stages.stages_of_rank(source.pp_rank), actions.stages.stages_of_rank(rank), strict=True))
    further = (rank - source.pp_rank) * stage_size
    gathers: dict[int, int] = {}
    events: list[Event] = []

    def add(event: Event, microbatches: list[int] | None = None) -> None:
        if isinstance(event, Mark) and event.what in ("F", "B", "I", "W") and microbatches is not None:
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

    for event in source.before:
        add(event)
    for position, (step, action) in enumerate(zip(taken, actions.orders[rank], strict=True)):
        microbatches = [microbatch for _, _, microbatch in _parts(action)]
        mark, *rest = source.steps[step]
        add(replace(mark, microbatch=position) if isinstance(mark, Mark) else mark)
        for event in rest:
            add(event, microbatches)
    for event in source.after:
        add(event)
    return Timeline(events)


def _parts(action: Any) -> list[tuple[str, int, int]]:
    """The kind, stage and microbatch (-1 for none) of each part of one of torch's actions."""
    parts = action.sub_actions if action.sub_actions is not None else (action,)
    return [
        (str(part.computation_type.value), part.stage_index, -1 if part.microbatch_index is None else part.microbatch_index)
        for part in parts
    ]
