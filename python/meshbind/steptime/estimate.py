"""One training step's time on a named cluster, from the step ``step_comms`` traced: each class of
ranks' operators and collectives priced in their order (``steptime/price.py``), a pipeline's
actions laid out in torch's schedule (``steptime/schedule.py``), then tokens per second per GPU
and MFU as torchtitan reports them."""

from __future__ import annotations

from collections import defaultdict
from functools import partial

from meshbind.comms.result import RankClassComms, StepComms
from meshbind.comms.timeline import Event, Mark, Timeline, Transfer
from meshbind.memory.depth import TRACED_DEPTHS
from meshbind.pipeline.schedules import STAGE_ACTIONS, ActionKey
from meshbind.steptime.cluster import Cluster
from meshbind.steptime.price import Spent, extrapolated, priced, transfer_seconds
from meshbind.steptime.result import RankClassTime, StepTime
from meshbind.steptime.schedule import scheduled_ends
from meshbind.world import PIPELINE_AXIS


def step_time(comms: StepComms, cluster: Cluster) -> StepTime:
    """The step ``comms`` traced, on ``cluster``: per class of ranks its compute, the waits on
    collectives by axes, a pipeline's bubble and the step; the slowest class sets the step, as
    every rank waits for the others at its collectives."""
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    world = comms.world
    if comms.settings.pipeline is None:
        classes = [_unpipelined(c, cluster) for c in comms.classes]
    else:
        classes = _pipelined(comms, cluster)
    step = max(c.step for c in classes)
    tokens = comms.settings.batch * comms.settings.seq_len / (world.cp * world.tp * world.pp)
    tokens_per_second = tokens / step if step > 0 else 0.0
    mfu = None if comms.flops_per_token is None else comms.flops_per_token * tokens_per_second / cluster.gpu.half_flops
    return StepTime(comms.settings, world, cluster, tuple(classes), step, tokens_per_second, comms.flops_per_token, mfu)


def _unpipelined(traced: RankClassComms, cluster: Cluster) -> RankClassTime:
    work = traced.work
    at_depths = [priced(timeline.events, cluster) for timeline in work.timelines]
    spent = at_depths[0]
    if work.full_depth is not None:
        full = extrapolated(at_depths, TRACED_DEPTHS, work.full_depth)
        if full is None:
            raise ValueError(
                f"ranks {traced.first_rank}+: the step's time does not grow by equal steps with the alike blocks "
                "(their overlap changes with depth): trace the whole model (alike_layers=False)"
            )
        spent = full
    return RankClassTime.of(traced, spent, bubble=0.0)


def _pipelined(comms: StepComms, cluster: Cluster) -> list[RankClassTime]:
    stages = comms.settings.pipeline
    assert stages is not None
    world = comms.world
    cut = [_Actions(c.work.timelines[0], cluster) for c in comms.classes]
    first_of_rank: dict[int, int] = {}
    for number, c in enumerate(comms.classes):
        first_of_rank.setdefault(world.coordinates(c.first_rank)[PIPELINE_AXIS], number)
    classes = []
    for number, c in enumerate(comms.classes):
        pp_rank = world.coordinates(c.first_rank)[PIPELINE_AXIS]
        # This class's own stages as it ran them, the others as the first class of their rank did.
        ran_by = {
            stage: number if stages.rank_of(stage) == pp_rank else first_of_rank[stages.rank_of(stage)]
            for stage in range(len(stages.stages))
        }
        ends = scheduled_ends(stages, world.pp, partial(_action_seconds, cut, ran_by), partial(_hop_seconds, cut, ran_by))
        own = cut[number]
        spent = Spent()
        for action in own.actions.values():
            spent.add(action)
        busy = spent.total
        # What the rank's last action left running beside it (FSDP's last reduce-scatter) holds the optimizer.
        last = own.actions[stages.order[pp_rank][-1][-1]]
        spent.waited(last.still_running_axes, last.still_running, beside=True)
        spent.add(own.after)
        classes.append(RankClassTime.of(c, spent, bubble=max(ends) - busy))
    return classes


class _Actions:
    """A pipelined rank's timeline cut at its action marks: each action priced, what follows the
    schedule priced, and what one of its sends takes."""

    def __init__(self, timeline: Timeline, cluster: Cluster) -> None:
        cut = timeline.cut(STAGE_ACTIONS)
        actions: dict[ActionKey, list[Event]] = defaultdict(list)
        for mark, *rest in cut.parts:
            assert isinstance(mark, Mark)
            actions[(mark.what, mark.stage, mark.microbatch)] += rest
        self.actions = {key: priced(part, cluster, settled=False) for key, part in actions.items()}
        # What comes before the first action (the batch cut into microbatches) is the step's.
        after = [*cut.before, *cut.after]
        sends = [transfer_seconds(e, cluster) for e in timeline.events if isinstance(e, Transfer) and e.kind == "send"]
        self.after = priced(after, cluster)
        self.hop = sum(sends) / len(sends) if sends else 0.0


def _action_seconds(cut: list[_Actions], ran_by: dict[int, int], action: ActionKey) -> float:
    return cut[ran_by[action[1]]].actions[action].total


def _hop_seconds(cut: list[_Actions], ran_by: dict[int, int], stage: int) -> float:
    return cut[ran_by[stage]].hop
