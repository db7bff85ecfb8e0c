"""What a trace hooks on torch's pipeline schedule, leaving its work as it is: each action as it
starts on this rank's stages, each step torch's runtime takes from the rank's list, and the lists
of actions the step runs. The schedule and its stages are the trace's own: nothing is put back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshbind.pipeline.runtime import Orders, torch_action
from meshbind.pipeline.schedules import RELEASE


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


def on_each_action(schedule: Any, starting: Callable[[int, str, int], None], ended: Callable[[], None]) -> None:
    """``starting(stage, kind, microbatch)`` called as each action torch's schedule runs on this
    rank's stages starts (kind as torch's actions name it: ``F``, ``B``, ``I`` for a backward that
    leaves the weights' gradients to a ``W``; under GPipe ``SEND_F`` too, as each forward's output
    is released after the wait on its send), ``ended()`` after the schedule's step. The schedule
    and its stages are the trace's own: nothing is put back."""
    from torch.distributed.pipelining.schedules import ScheduleGPipe

    for stage in stages_of(schedule):
        index = stage.stage_index
        stage.forward_one_chunk = _starting(starting, index, "F", stage.forward_one_chunk)
        stage.backward_one_chunk = _starting(starting, index, "B", stage.backward_one_chunk)
        stage.backward_weight_one_chunk = _starting(starting, index, "W", stage.backward_weight_one_chunk)
        if isinstance(schedule, ScheduleGPipe):  # its waits on the sends all follow the last forward
            stage.release_fwd_send_outputs = _starting(starting, index, RELEASE, stage.release_fwd_send_outputs)
    run = schedule.step

    def step(*args: Any, **kwargs: Any) -> None:
        run(*args, **kwargs)
        ended()

    schedule.step = step


def _starting(starting: Callable[[int, str, int], None], stage: int, kind: str, run: Callable[..., Any]) -> Callable[..., Any]:
    def started(chunk: int, *args: Any, **kwargs: Any) -> Any:
        starting(stage, "I" if kind == "B" and kwargs.get("full_backward") is False else kind, chunk)
        return run(chunk, *args, **kwargs)

    return started


def actions_run(schedule: Any, runtime_lists: Orders | None) -> Orders:
    """The lists of actions a traced step runs: every rank's runtime list (``runtime_lists``, from
    ``on_each_runtime_step``), or under a single-stage schedule (torch's own loop, no list) this
    rank's actions as each starts, filled in as the step runs."""
    if runtime_lists is not None:
        return runtime_lists
    ran: list[Any] = []
    on_each_action(schedule, lambda stage, kind, microbatch: ran.append(torch_action(kind, stage, microbatch)), lambda: None)
    return {stages_of(schedule)[0].stage_index: ran}  # one stage a rank: its index is the rank's


def stages_of(schedule: Any) -> list[Any]:
    """The stages a schedule runs: torch keeps them as ``_stage`` (one per rank) or ``_stages``."""
    return list(getattr(schedule, "_stages", None) or [schedule._stage])
