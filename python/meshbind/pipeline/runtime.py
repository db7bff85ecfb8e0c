"""torch's pipeline runtime, as the traces read it: every multi-stage schedule runs each rank's list
of actions in order (``pipeline_order_with_comms``: forwards, backwards, sends, receives, FSDP's
unshards and reductions), and an action on one rank does what an action on another did when both
are *twins*: the same kind of action on a stage of the same modules at the same place of the rank
(the "v" of a two-stage schedule goes down, then up), with the same neighbours on the rank, and
both the stage's first of that kind, its last, or neither (FSDP gathers in the first, reduces in
the last). A rank whose every action has a twin on a traced rank holding the same stages' modules
can be put together from that rank's actions in its own order (``comms/composed.py``,
``memory/composed.py``). torch lowers the lists from the schedule alone, so which ranks to trace is
known before any is traced (``traced_and_put_together``). A single-stage schedule runs torch's own
loop instead; its actions are read from the schedule's order (``single_stage_orders``), and a rank
is put together from its own actions, or (between the first stage and the last) from another's
(``RankActions.single_stage``)."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from meshbind.forks import in_forks
from meshbind.pipeline.schedules import RELEASE, STAGE_ACTIONS
from meshbind.pipeline.stages import PipelineStages

Orders = dict[int, list[Any]]
"""torch's runtime lists: each pipeline rank's actions (torch's ``_Action``s)."""
ActionTwin = tuple[object, ...]
Traced = TypeVar("Traced")
Answer = TypeVar("Answer")


def lowered_orders(stages: PipelineStages) -> Orders:
    """torch's runtime lists of a multi-stage schedule, as its constructor lowers them from the
    compute order and the schedule's settings alone: built here over stand-in stages, as torch's
    schedule pictures build them (``get_schedule_ops``), with the settings a traced step uses."""
    schedule = stages.schedule
    return _lowered_orders(schedule.name, stages.pp, len(stages.stages) // stages.pp, stages.microbatches)


@functools.cache  # asked for by every trace of the same world
def _lowered_orders(name: str, pp: int, stages_per_rank: int, microbatches: int) -> Orders:
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ranks = get_schedule_ops(name, pp, microbatches, stages_per_rank, with_comms=True)
    return {rank: [action for action in actions if action is not None] for rank, actions in enumerate(ranks)}


@dataclass(frozen=True)
class RankActions:
    """What tells a pipeline rank's actions apart for putting ranks together: the twin key of each
    action in its runtime list, and of the rank's stages."""

    stages: PipelineStages
    signatures: Sequence[object]
    """Each stage's modules, told apart (``pipeline.alike.stage_signatures``)."""
    orders: Orders
    single_stage: bool = False
    """The actions of a single-stage schedule (torch's own loop, no runtime list: ``single_stage_orders``).
    Its trace is cut where each action starts, so an action's part holds the sends, receives and
    waits the loop runs up to the next one: its twin also has the same kinds of action before and
    after it, and is on the same rank or, where both receive and send, on another that does
    (``_sends_and_receives``: neither holds the first stage nor the last)."""
    traced: RankActions | None = None
    """The same pipeline's actions at fewer microbatches of the same size, where the ranks are
    traced: every rank, a traced one too, is put together from a traced rank's actions there
    (``with_fewer_microbatches``). ``None``: the ranks are traced at this step itself."""
    _action_twins: dict[int, list[ActionTwin]] = field(default_factory=dict, compare=False, repr=False)
    _first_twins: dict[int, dict[ActionTwin, int]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def traced_orders(self) -> Orders:
        """The lists of actions the traced ranks run."""
        return (self.traced or self).orders

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
        for position, parts in enumerate(runs):
            twin: list[object] = []
            for kind, stage, microbatch in parts:
                family = (kind, stage)
                seen[family] += 1
                role = (seen[family] == 1, seen[family] == total[family], ran.get((stage, microbatch), frozenset()))
                twin.append((kind, self.signatures[stage], mine.index(stage), stage - 1 in mine, stage + 1 in mine, role))
            for kind, stage, microbatch in parts:
                if kind in STAGE_ACTIONS:
                    ran[stage, microbatch] = ran.get((stage, microbatch), frozenset()) | {kind}
            if self.single_stage:
                twin.append(tuple(_kinds(runs, at) for at in (position - 1, position + 1)))
            twins.append(tuple(twin))
        return twins

    def twin_positions(self, rank: int, source: int) -> list[int] | None:
        """Where in ``source``'s traced list (``traced_orders``) each of ``rank``'s actions has its
        twin, when ``source`` holds the same stages' modules and has a twin of every one; else ``None``."""
        tracing = self.traced or self
        if tracing.stage_twins(source) != self.stage_twins(rank):
            return None
        if self.single_stage and source != rank and not self._sends_and_receives(rank, source):
            return None
        at = tracing._first_twin_positions(source)
        positions = [at.get(twin, -1) for twin in self.action_twins(rank)]
        return None if -1 in positions else positions

    def _sends_and_receives(self, *ranks: int) -> bool:
        """Whether each of ``ranks`` receives its stage's inputs and sends its outputs (holds
        neither the first stage nor the last), as a part of each of its actions then does alike."""
        edges = {0, len(self.stages.stages) - 1}
        return not any(edges & set(self.stages.stages_of_rank(rank)) for rank in ranks)

    def _first_twin_positions(self, source: int) -> dict[ActionTwin, int]:
        if (at := self._first_twins.get(source)) is None:  # asked of each traced rank for every other
            at = self._first_twins[source] = {}
            for position, twin in enumerate(self.action_twins(source)):
                at.setdefault(twin, position)
        return at


def _kinds(runs: list[list[tuple[str, int, int]]], position: int) -> tuple[str, ...]:
    """The kinds of the action at ``position`` of a rank's list; none before the first or after the last."""
    return tuple(kind for kind, _, _ in runs[position]) if 0 <= position < len(runs) else ()


def single_stage_orders(stages: PipelineStages) -> Orders:
    """Each pipeline rank's actions under a single-stage schedule, in the order torch's own loop
    runs them (``PipelineStages.order``), as torch's actions; under GPipe each forward's release
    (``RELEASE``) follows the last forward, in the forwards' order."""
    orders = {}
    for rank, steps in enumerate(stages.order):
        actions = [action for step in steps for action in step]
        if stages.schedule.frees_outputs_together:
            forwards = [action for action in actions if action[0] == "F"]
            after = actions.index(forwards[-1]) + 1
            actions[after:after] = [(RELEASE, stage, microbatch) for _, stage, microbatch in forwards]
        orders[rank] = [torch_action(*action) for action in actions]
    return orders


def torch_action(kind: str, stage: int, microbatch: int) -> Any:
    """torch's action of ``kind`` (as torch names it: ``F``, ``B``, ...) on a stage and microbatch."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    return _Action(stage, _ComputationType.from_str(kind), microbatch)


def with_fewer_microbatches(actions: RankActions) -> RankActions:
    """``actions`` traced at the fewest microbatches (of the same size) whose lists give every
    rank a twin of each of its own actions, so that a trace's cost no longer grows with the
    microbatches; ``actions`` itself where no fewer do. The twins do not depend on the microbatches'
    count (``_twins_of_actions``): an action allocates and frees, sends and gathers what its twin does."""
    stages = actions.stages
    for microbatches in range(1, stages.microbatches):
        if stages.schedule.problems(stages.pp, len(stages.stages), microbatches):
            continue
        fewer = replace(stages, microbatches=microbatches)
        orders = single_stage_orders(fewer) if actions.single_stage else lowered_orders(fewer)
        at_fewer = replace(actions, stages=fewer, orders=orders, _action_twins={}, _first_twins={})
        traced = replace(actions, traced=at_fewer, _first_twins={})
        if all(traced.twin_positions(rank, rank) is not None for rank in range(stages.pp)):
            return traced
    return actions


def action_parts(action: Any) -> list[tuple[str, int, int]]:
    """The kind, stage and microbatch (-1 for none) of each part of one of torch's actions."""
    parts = action.sub_actions if action.sub_actions is not None else (action,)
    return [
        (str(part.computation_type.value), part.stage_index, -1 if part.microbatch_index is None else part.microbatch_index)
        for part in parts
    ]


def traced_sources(places: list[tuple[int, int, int]], actions: RankActions | None) -> list[tuple[int, list[int] | None]]:
    """For each pipeline rank class (by its pipeline rank, its first rank within it and its ranks),
    the class whose trace it reads, by position: itself where it is traced (with its own twins
    there when it is traced at fewer microbatches, ``RankActions.traced``); else, with the
    positions of the twins of its actions, a traced rank's that has a twin of each
    (``RankActions.twin_positions``). Where a rank must be traced and an alike later one would put
    it together, that one is traced instead: the one that would put together the most."""
    traced: dict[tuple[int, int], list[int]] = {}  # positions, by first rank within the pipeline rank and ranks
    sources: list[tuple[int, list[int] | None] | None] = [None] * len(places)
    for position, (pp_rank, within, count) in enumerate(places):
        if sources[position] is not None:  # traced ahead
            continue
        if actions is not None:
            found: tuple[int, list[int] | None] | None = next(
                ((source, taken) for source in traced.get((within, count), [])
                 if (taken := actions.twin_positions(pp_rank, places[source][0])) is not None),
                None,
            )  # fmt: skip
            if found is None:
                later = {places[other][0]: other for other in range(position + 1, len(places))
                         if places[other][1:] == (within, count) and sources[other] is None}  # fmt: skip
                if (stand_in := _widest_source(pp_rank, list(later), actions)) is not None:
                    sources[later[stand_in]] = (later[stand_in], _own_twins(stand_in, actions))
                    traced.setdefault((within, count), []).append(later[stand_in])
                    found = (later[stand_in], actions.twin_positions(pp_rank, stand_in))
            if found is not None:
                sources[position] = found
                continue
        sources[position] = (position, _own_twins(pp_rank, actions))
        traced.setdefault((within, count), []).append(position)
    return [source for source in sources if source is not None]


def _own_twins(rank: int, actions: RankActions | None) -> list[int] | None:
    """Where a traced rank's actions have their twins in its own trace: ``None`` (it is its own
    answer) unless it is traced at fewer microbatches."""
    return actions.twin_positions(rank, rank) if actions is not None and actions.traced is not None else None


def _widest_source(rank: int, later: list[int], actions: RankActions) -> int | None:
    """Of the ``later`` pipeline ranks, the one with a twin of each of ``rank``'s actions that has
    twins of the most of the others' too; ``None`` where none has ``rank``'s."""
    covering = [source for source in later if actions.twin_positions(rank, source) is not None]
    widths = [sum(actions.twin_positions(other, source) is not None for other in later) for source in covering]
    return covering[widths.index(max(widths))] if covering else None


def traced_and_put_together(
    places: list[tuple[int, int, int]],
    actions: RankActions | None,
    trace: Callable[[int], tuple[Traced, Orders | None]],
    answer: Callable[[int, int, list[int] | None, Traced], Answer],
    tracing: Callable[[int], str],
) -> list[Answer]:
    """Each pipeline rank class's answer, by position in ``places`` (as ``traced_sources`` takes
    them): the classes ``traced_sources`` picks traced side by side (``trace(position)``, which
    gives the traced rank's runtime lists too), then ``answer(position, source, taken, traced)`` for
    every class from its source's trace (``taken``: the twins of its actions there, ``None`` where
    the trace is its answer). A traced rank that ran other lists than ``actions``' traced ones
    (read ahead; ``trace`` gives the lists its step ran: every rank's under torch's runtime, its
    own under a single-stage schedule) is a ``RuntimeError``: the ranks put together would be wrong."""
    sources = traced_sources(places, actions)
    positions = [position for position, (source, _) in enumerate(sources) if source == position]
    traced: dict[int, Traced] = {}
    for position, (found, orders) in zip(positions, in_forks(trace, positions, tracing), strict=True):
        if actions is not None and (
            orders is None or any(actions.traced_orders.get(rank) != ran for rank, ran in orders.items())
        ):
            raise RuntimeError(
                f"{tracing(position)}: torch ran other lists of actions than are read from the schedule alone "
                "(the runtime's lowered lists, or a single-stage schedule's loop); the ranks put together from it would be wrong"
            )
        traced[position] = found
    return [answer(position, source, taken, traced[source]) for position, (source, taken) in enumerate(sources)]
