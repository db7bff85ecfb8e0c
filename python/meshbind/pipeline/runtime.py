"""torch's pipeline runtime, as the traces read it: every multi-stage schedule runs each rank's list
of actions in order (``pipeline_order_with_comms``: forwards, backwards, sends, receives, FSDP's
unshards and reductions), and an action on one rank does what an action on another did when both
are *twins*: the same kind of action on a stage of the same modules at the same place of the rank
(the "v" of a two-stage schedule goes down, then up), with the same neighbours on the rank, and
both the stage's first of that kind, its last, or neither (FSDP gathers in the first, reduces in
the last). A rank whose every action has a twin on a traced rank holding the same stages' modules
can be put together from that rank's actions in its own order (``comms/composed.py``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshbind.pipeline.schedules import STAGE_ACTIONS
from meshbind.pipeline.stages import PipelineStages

Orders = dict[int, list[Any]]
"""torch's runtime lists: each pipeline rank's actions (torch's ``_Action``s)."""
ActionTwin = tuple[object, ...]


class _Taking(list[Any]):
    """A rank's list of actions that calls each of its ``taken`` hooks with an action's position as
    torch's runtime takes it (step memory's and the collectives' watches, together, each add one)."""

    def __init__(self, actions: list[Any]) -> None:
        super().__init__(actions)
        self.taken: list[Callable[[int], None]] = []

    def __iter__(self) -> Any:
        for position, action in enumerate(super().__iter__()):
            for taken in self.taken:
                taken(position)
            yield action


def on_each_runtime_step(schedule: Any, taken: Callable[[int], None]) -> Orders | None:
    """Every rank's list of actions under torch's runtime, ``taken(position)`` called as the
    schedule's own rank takes each; ``None`` for a single-stage schedule, which has no such list."""
    orders = getattr(schedule, "pipeline_order_with_comms", None)
    if not orders:
        return None
    lists = {rank: actions[:] for rank, actions in orders.items()}  # sliced: iterating a `_Taking` calls its hooks
    mine = orders[schedule.rank]
    if not isinstance(mine, _Taking):
        mine = orders[schedule.rank] = _Taking(mine)
    mine.taken.append(taken)
    return lists


@dataclass(frozen=True)
class RankActions:
    """What tells a pipeline rank's actions apart for putting ranks together: the twin key of each
    action in its runtime list, and of the rank's stages."""

    stages: PipelineStages
    signatures: Sequence[object]
    """Each stage's modules, told apart (``pipeline.alike.stage_signatures``)."""
    orders: Orders
    _action_twins: dict[int, list[ActionTwin]] = field(default_factory=dict, compare=False, repr=False)

    def stage_twins(self, rank: int) -> tuple[object, ...]:
        mine = self.stages.stages_of_rank(rank)
        return tuple((self.signatures[stage], stage - 1 in mine, stage + 1 in mine) for stage in mine)

    def action_twins(self, rank: int) -> list[ActionTwin]:
        if rank not in self._action_twins:  # read for every pair of ranks when choosing which to trace
            self._action_twins[rank] = self._twins_of_actions(rank)
        return self._action_twins[rank]

    def _twins_of_actions(self, rank: int) -> list[ActionTwin]:
        mine = self.stages.stages_of_rank(rank)
        runs = [action_parts(action) for action in self.orders[rank]]
        total = Counter((kind, stage) for parts in runs for kind, stage, _ in parts)
        seen: Counter[tuple[str, int]] = Counter()
        ran: dict[tuple[int, int], frozenset[str]] = {}  # by stage and microbatch: its computations run so far
        twins: list[ActionTwin] = []
        for parts in runs:
            twin: list[object] = []
            for kind, stage, microbatch in parts:
                family = (kind, stage)
                seen[family] += 1
                role = (seen[family] == 1, seen[family] == total[family], ran.get((stage, microbatch), frozenset()))
                twin.append((kind, self.signatures[stage], mine.index(stage), stage - 1 in mine, stage + 1 in mine, role))
            for kind, stage, microbatch in parts:
                if kind in STAGE_ACTIONS:
                    ran[stage, microbatch] = ran.get((stage, microbatch), frozenset()) | {kind}
            twins.append(tuple(twin))
        return twins

    def twin_positions(self, rank: int, source: int) -> list[int] | None:
        """Where in ``source``'s list each of ``rank``'s actions has its twin, when ``source`` holds
        the same stages' modules and has a twin of every one; else ``None``."""
        if self.stage_twins(source) != self.stage_twins(rank):
            return None
        at: dict[ActionTwin, int] = {}
        for position, twin in enumerate(self.action_twins(source)):
            at.setdefault(twin, position)
        wanted = self.action_twins(rank)
        if not all(twin in at for twin in wanted):
            return None
        return [at[twin] for twin in wanted]


def action_parts(action: Any) -> list[tuple[str, int, int]]:
    """The kind, stage and microbatch (-1 for none) of each part of one of torch's actions."""
    parts = action.sub_actions if action.sub_actions is not None else (action,)
    return [
        (str(part.computation_type.value), part.stage_index, -1 if part.microbatch_index is None else part.microbatch_index)
        for part in parts
    ]


def traced_sources(
    places: list[tuple[int, int, int]], alike: dict[int, int], actions: RankActions | None
) -> list[tuple[int, list[int] | None]]:
    """For each pipeline rank class (by its pipeline rank, its first rank within it and its ranks),
    the class whose trace it reads, by position: itself where it is traced; an alike rank's under a
    single-stage schedule; else, with the positions of the twins of its actions, a traced rank's
    that has a twin of each (``RankActions.twin_positions``). Where a rank must be traced and an
    alike later one would put it together, that one is traced instead: the one that would put
    together the most."""
    position_of = {place: position for position, place in enumerate(places)}
    traced: dict[tuple[int, int], list[int]] = {}  # positions, by first rank within the pipeline rank and ranks
    sources: list[tuple[int, list[int] | None] | None] = [None] * len(places)
    for position, (pp_rank, within, count) in enumerate(places):
        if sources[position] is not None:  # traced ahead
            continue
        if (alike_place := (alike.get(pp_rank, -1), within, count)) in position_of:
            sources[position] = (position_of[alike_place], None)
            continue
        if actions is not None and position > 0:
            found: tuple[int, list[int] | None] | None = next(
                ((source, taken) for source in traced.get((within, count), [])
                 if (taken := actions.twin_positions(pp_rank, places[source][0])) is not None),
                None,
            )  # fmt: skip
            if found is None:
                later = {places[other][0]: other for other in range(position + 1, len(places))
                         if places[other][1:] == (within, count) and sources[other] is None}  # fmt: skip
                if (stand_in := _widest_source(pp_rank, list(later), actions)) is not None:
                    sources[later[stand_in]] = (later[stand_in], None)
                    traced.setdefault((within, count), []).append(later[stand_in])
                    found = (later[stand_in], actions.twin_positions(pp_rank, stand_in))
            if found is not None:
                sources[position] = found
                continue
        sources[position] = (position, None)
        traced.setdefault((within, count), []).append(position)
    return [source for source in sources if source is not None]


def _widest_source(rank: int, later: list[int], actions: RankActions) -> int | None:
    """Of the ``later`` pipeline ranks, the one with a twin of each of ``rank``'s actions that has
    twins of the most of the others' too; ``None`` where none has ``rank``'s."""
    covering = [source for source in later if actions.twin_positions(rank, source) is not None]
    widths = [sum(actions.twin_positions(other, source) is not None for other in later) for source in covering]
    return covering[widths.index(max(widths))] if covering else None
