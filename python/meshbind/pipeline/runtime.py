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

from meshbind.pipeline.stages import PipelineStages

Orders = dict[int, list[Any]]
"""torch's runtime lists: each pipeline rank's actions (torch's ``_Action``s)."""
ActionTwin = tuple[object, ...]


class _Taking(list[Any]):
    """A rank's list of actions that calls ``taken(position)`` as torch's runtime takes each."""

    def __init__(self, actions: list[Any], taken: Callable[[int], None]) -> None:
        super().__init__(actions)
        self._taken = taken

    def __iter__(self) -> Any:
        for position, action in enumerate(super().__iter__()):
            self._taken(position)
            yield action


def on_each_runtime_step(schedule: Any, taken: Callable[[int], None]) -> Orders | None:
    """Every rank's list of actions under torch's runtime, ``taken(position)`` called as the
    schedule's own rank takes each; ``None`` for a single-stage schedule, which has no such list."""
    orders = getattr(schedule, "pipeline_order_with_comms", None)
    if not orders:
        return None
    lists = {rank: list(actions) for rank, actions in orders.items()}
    orders[schedule.rank] = _Taking(orders[schedule.rank], taken)
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
        twins: list[ActionTwin] = []
        for parts in runs:
            twin: list[object] = []
            for kind, stage, _ in parts:
                family = (kind, stage)
                seen[family] += 1
                role = (seen[family] == 1, seen[family] == total[family])
                twin.append((kind, self.signatures[stage], mine.index(stage), stage - 1 in mine, stage + 1 in mine, role))
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
