"""The pipeline schedules torch ships, by the names torch's ``get_schedule_class`` takes, and what
each needs of the stages and microbatches, checked before any stage is built (offline as online).

Single-stage schedules (``GPipe``, ``1F1B``) run one stage per rank; the others run several:
``Interleaved1F1B``, ``LoopedBFS`` and ``InterleavedZeroBubble`` place stage ``r + s·pp`` on rank
``r`` ("loop"), ``ZBVZeroBubble`` and ``DualPipeV`` two stages per rank, ``r`` and ``2·pp - 1 - r``
("v"), as torchtitan places them.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

from meshbind.forks import dealt, in_forks
from meshbind.names import ActivationCheckpointing, Checkpointing


@dataclass(frozen=True)
class Schedule:
    """One of torch's schedules: its name, whether it runs one stage per rank, and how stages are
    placed on ranks under it (``"loop"`` or ``"v"``)."""

    name: str
    single_stage: bool
    placement: str = "loop"
    splits_backward: bool = False
    """Whether it runs a backward in two (the inputs' gradients, later the weights'): the zero-bubble schedules."""
    frees_outputs_together: bool = False
    """Whether it waits on every forward's send at once, after the last forward, freeing every
    microbatch's output there (GPipe): each wait and release is then an action of its own
    (``RELEASE``), so that what one frees does not grow with the microbatches."""

    def default_stages_per_rank(self) -> int:
        """torchtitan's default: one for a single-stage schedule, two otherwise."""
        return 1 if self.single_stage else 2

    def stages_on_rank(self, rank: int, pp: int, stages: int) -> tuple[int, ...]:
        """The stage indices pipeline rank ``rank`` runs, in its order."""
        per_rank = stages // pp
        if self.placement == "v":
            return (rank, stages - 1 - rank)
        return tuple(rank + index * pp for index in range(per_rank))

    def checkpointing_problem(self, checkpointing: Checkpointing) -> str | None:
        """Why this schedule cannot run under ``checkpointing``: torch's selective (per-operator)
        checkpointing allows one backward over a region, and a split backward runs two."""
        if self.splits_backward and checkpointing.mode is ActivationCheckpointing.SELECTIVE_OP:
            return (
                f"{self.name} runs each backward in two (the inputs' gradients, then the weights'), but torch's "
                "selective-op checkpointing allows one backward over a region: use full checkpointing or none, "
                "or a schedule that does not split the backward"
            )
        return None

    def problems(self, pp: int, stages: int, microbatches: int) -> list[str]:
        """What ``pp`` ranks running ``stages`` stages over ``microbatches`` microbatches break of
        this schedule's needs; empty when it can run."""
        found = []
        if stages % pp:
            found.append(f"{stages} stages do not divide over pp={pp} ranks: use a multiple of {pp}")
            return found
        per_rank = stages // pp
        if self.single_stage and per_rank != 1:
            found.append(f"{self.name} runs one stage per rank, but {stages} stages over pp={pp} put {per_rank} on each")
        if not self.single_stage and per_rank < 2:
            found.append(f"{self.name} runs several stages per rank, but {stages} stages over pp={pp} put one on each")
        if self.placement == "v" and per_rank != 2:
            found.append(f"{self.name} places two stages per rank (a 'v'), but {stages} stages over pp={pp} put {per_rank}")
        if self.name in ("1F1B", "DualPipeV") and microbatches < stages:  # torch's constructors refuse fewer
            found.append(
                f"{self.name} needs at least as many microbatches as stages: {microbatches} microbatches, {stages} stages"
            )
        if self.placement == "loop" and not self.single_stage:
            rounds = max(1, microbatches // pp)
            if microbatches % rounds:
                found.append(
                    f"{self.name} runs microbatches in rounds of pp={pp}: {microbatches} microbatches make "
                    f"{rounds} rounds that do not divide them; use a multiple of {pp} or fewer than {2 * pp}"
                )
        return found


SCHEDULES = {
    schedule.name: schedule
    for schedule in (
        Schedule("GPipe", single_stage=True, frees_outputs_together=True),
        Schedule("1F1B", single_stage=True),
        Schedule("Interleaved1F1B", single_stage=False),
        Schedule("LoopedBFS", single_stage=False),
        Schedule("InterleavedZeroBubble", single_stage=False, splits_backward=True),
        Schedule("ZBVZeroBubble", single_stage=False, placement="v", splits_backward=True),
        Schedule("DualPipeV", single_stage=False, placement="v", splits_backward=True),
    )
}
"""Every schedule torch ships, by torch's name."""


def schedule_named(name: str, what: str = "schedule") -> Schedule:
    """The schedule ``name`` (any case, as torch reads it); a ``ValueError`` naming ``what`` and
    the choices otherwise."""
    by_lower = {key.lower(): schedule for key, schedule in SCHEDULES.items()}
    if not isinstance(name, str) or name.lower() not in by_lower:
        raise ValueError(f"{what} must be one of {', '.join(SCHEDULES)}, got {name!r}")
    return by_lower[name.lower()]


ActionKey = tuple[str, int, int]
"""A stage's action as torch names it: kind, stage, microbatch."""
STAGE_ACTIONS = ("F", "B", "I", "W")
"""torch's kinds of a stage's actions: forward, full backward, the backward for inputs only, the
weights' gradients."""
RELEASE = "SEND_F"
"""torch's kind of a forward's send: under GPipe, the wait on it that releases the microbatch's
output, an action of its own (``Schedule.frees_outputs_together``)."""
RunOrder = tuple[tuple[tuple[ActionKey, ...], ...], ...]
"""Each pipeline rank's steps in the order torch runs them, each step the stage actions it runs."""


def schedule_actions(schedule: Schedule, pp: int, stages: int, microbatches: int) -> list[list[Any]]:
    """torch's own order of each pipeline rank's actions (``get_schedule_ops``, which builds the
    schedule over stand-in stages, so torch's own checks of the schedule run too), idle slots
    dropped. A ``ValueError`` carries torch's refusal."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # builds a schedule

    try:
        with _compute_order_only():
            actions = get_schedule_ops(schedule.name, pp, microbatches, stages // pp)
    except (ValueError, AssertionError, RuntimeError) as error:
        raise ValueError(
            f"torch refuses {schedule.name} with {microbatches} microbatches over {stages} stages: {error}"
        ) from None
    return [[action for action in rank if action is not None] for rank in actions]


@contextlib.contextmanager
def _compute_order_only() -> Iterator[None]:
    """A multi-stage schedule's constructor lowers its order into the runtime's list with FSDP's
    unshards, sends and receives (``_prepare_schedule_with_comms``), in time quadratic in the
    actions, and the order read here is the compute order before it: while it is read, the
    lowering checks the stages' placement (``_validate_and_set_stage_mapping``) and stops there.
    A traced step builds its schedule without this, lowered in full.

    The stand-in stage is specced on torch's stage class as ``get_schedule_ops`` specs it (an
    attribute the class lacks is refused alike), without autospec's copy of every method's
    signature, which took most of the rules pass's schedule time (20 ms a schedule)."""
    from torch.distributed.pipelining import _schedule_visualizer
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    lower = _PipelineScheduleRuntime._prepare_schedule_with_comms
    stand_ins = _schedule_visualizer.mock  # type: ignore[attr-defined]

    def placement_checked(self: Any, actions: dict[int, list[Any]], format: str = "compute_only") -> None:
        self._validate_and_set_stage_mapping(actions)

    _PipelineScheduleRuntime._prepare_schedule_with_comms = placement_checked  # type: ignore[method-assign]
    _schedule_visualizer.mock = _SpeccedStandIns  # type: ignore[attr-defined,assignment]
    try:
        yield
    finally:
        _PipelineScheduleRuntime._prepare_schedule_with_comms = lower  # type: ignore[method-assign]
        _schedule_visualizer.mock = stand_ins  # type: ignore[attr-defined]


class _SpeccedStandIns:
    """What ``get_schedule_ops`` reads of ``unittest.mock`` while a compute order is read."""

    @staticmethod
    def create_autospec(spec: type, instance: bool = True) -> mock.NonCallableMagicMock:
        return mock.NonCallableMagicMock(spec=spec)


def in_flight(order: RunOrder, stages: int) -> tuple[int, ...]:
    """For each of ``stages`` stages, the most microbatches it has run forward and not yet backward
    at any point of each rank's ``order`` (``run_order``). A microbatch is in flight from its
    forward (``F``) to its full backward (``B``) or, split in two under a zero-bubble schedule, to
    its weight gradients (``W``): until then its activations are held."""
    held: Counter[int] = Counter()
    most: Counter[int] = Counter()
    for kind, stage, _ in (part for rank in order for step in rank for part in step):
        if kind == "F":
            held[stage] += 1
            most[stage] = max(most[stage], held[stage])
        elif kind in ("B", "W"):
            held[stage] -= 1
    return tuple(most[stage] for stage in range(stages))


OrderKey = tuple[Schedule, int, int, int]
"""A schedule, ``pp``, the stages and the microbatches: what an order is a pure function of."""
_ORDERS: dict[OrderKey, RunOrder] = {}
"""Each order made in this process (torch builds each over stand-in stages, slowly; a search asks
for the same order per world)."""


def run_order(schedule: Schedule, pp: int, stages: int, microbatches: int) -> RunOrder:
    """``_torchs_order``, made once a process."""
    key = (schedule, pp, stages, microbatches)
    if key not in _ORDERS:
        _ORDERS[key] = _torchs_order(*key)
    return _ORDERS[key]


def run_orders_side_by_side(keys: Iterable[OrderKey], shares: int) -> None:
    """The orders of ``keys`` not made yet, made in up to ``shares`` forked children side by side
    and kept here, so that ``run_order`` answers them at once. An order torch refuses is left for
    ``run_order`` to meet again, where its caller answers the refusal."""
    import torch.distributed.pipelining._schedule_visualizer  # noqa: F401  # imported once here, not in each child

    missing = [key for key in dict.fromkeys(keys) if key not in _ORDERS]
    shared = dealt(missing, shares)
    answers = in_forks(
        lambda share: [_order_or_none(key) for key in share], shared, lambda share: f"ordering {len(share)} schedules"
    )
    for share, orders in zip(shared, answers, strict=True):
        _ORDERS.update((key, order) for key, order in zip(share, orders, strict=True) if order is not None)


def _order_or_none(key: OrderKey) -> RunOrder | None:
    try:
        return _torchs_order(*key)
    except ValueError:  # torch's refusal, answered where run_order meets it
        return None


def _torchs_order(schedule: Schedule, pp: int, stages: int, microbatches: int) -> RunOrder:
    """Each pipeline rank's actions in the order torch runs them, each as the stage actions it runs
    (DualPipeV's overlapped forward and backward as both). A multi-stage schedule runs its
    ``pipeline_order``; torch's single-stage 1F1B runs its own loop (``Schedule1F1B._step_microbatches``:
    ``min(m, p - r)`` forwards, then a backward and a forward in turn, then the backwards left),
    which its ``pipeline_order`` (drawn for pictures) gives otherwise on the last rank."""
    m = microbatches
    if schedule.name == "1F1B":
        orders = []
        for rank in range(pp):
            warmup = min(m, pp - rank)
            order = [("F", rank, mb) for mb in range(warmup)]
            for mb in range(m):
                order.append(("B", rank, mb))
                if warmup + mb < m:
                    order.append(("F", rank, warmup + mb))
            orders.append(tuple((action,) for action in order))
        return tuple(orders)
    ranks = schedule_actions(schedule, pp, stages, m)
    return tuple(tuple(parts for action in rank if (parts := _parts(action))) for rank in ranks)


def _parts(action: Any) -> tuple[ActionKey, ...]:
    """The stage actions an action runs; none for FSDP's and the sends' own, which the traced
    actions already hold."""
    actions = action.sub_actions if action.sub_actions is not None else (action,)
    found = [(str(part.computation_type.value), part.stage_index, part.microbatch_index) for part in actions]
    return tuple(part for part in found if part[0] in STAGE_ACTIONS)
