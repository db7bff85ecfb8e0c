"""Every collective of one training step of the planned model, traced: the step runs as step
memory runs it (``memory/fake_step.py``: the plan really applied over torch's fake process group,
fake tensors), and each collective it dispatches is counted (``comms/record.py``). One rank is
traced per class of ranks holding alike shards (``plan_report``'s rank groups)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from meshbind.comms.composed import TracedRank, marked_runtime_steps, put_together
from meshbind.comms.record import Collective, CollectiveRecord, GroupAxes, collectives_in
from meshbind.comms.result import RankClassComms, StepComms
from meshbind.comms.timeline import OPTIMIZER, SCHEDULE_END, Timeline, TracedWork
from meshbind.forks import in_forks
from meshbind.memory.depth import TRACED_DEPTHS, AlikeRun
from meshbind.memory.fake_step import step_errors
from meshbind.memory.pipelined import PipelinedStep, pipelined_step, run_pipelined_fake_step
from meshbind.memory.step import StepInputs
from meshbind.memory.trace import TracedModels, put_together_text, traced_step_settings, tracing_text
from meshbind.mesh import MeshContext
from meshbind.model_flops import model_flops_per_token
from meshbind.names import ActivationCheckpointing, Checkpointing, Device, Optimizer
from meshbind.pipeline import Pipeline, stages_text
from meshbind.pipeline.hooks import actions_run, on_each_action
from meshbind.pipeline.runtime import Orders, RankActions, traced_and_put_together
from meshbind.report import RankGroup, plan_report
from meshbind.resolution.plan import ParallelPlan
from meshbind.routing import Routing
from meshbind.world import PIPELINE_AXIS, World


def step_comms(
    build: Callable[[], nn.Module],
    plan: ParallelPlan,
    *,
    batch: int,
    seq_len: int,
    optimizer: str = Optimizer.ADAM,
    activation_checkpointing: str | Checkpointing = ActivationCheckpointing.NONE,
    device: str = Device.CUDA,
    routing: Routing | None = None,
    inputs: StepInputs | None = None,
    pipeline: Pipeline | None = None,
    alike_layers: bool = True,
) -> StepComms:
    """Every collective one training step (forward, backward, optimizer step) issues on each class
    of ranks: its kind, the mesh axes of its group and the group's size, the dtype, the calls and
    their bytes (as nccl-tests sizes them; ``comms/record.py``).

    ``build``, ``plan``, ``batch``, ``seq_len``, ``inputs`` and the settings are ``step_memory``'s,
    and the step is the one it traces: FSDP2's all-gathers and reduce-scatters (HSDP's all-reduce
    too), TP's and sequence parallelism's, CP's and EP's all-to-all under the same ``routing``.
    With ``alike_layers`` (the default) a model whose blocks end in more than five alike ones is
    traced at three, four and five of them and each collective's calls and bytes extrapolated,
    where they grow by equal steps (exact), as step memory extrapolates; else traced whole.
    Under a pipeline (``pp`` above 1, ``pipeline`` as ``step_memory`` takes it) each class runs its
    stages' step under torch's schedule, and the stages' sends and receives are counted too; each
    stage is traced whole, and with ``alike_layers`` a pipeline rank whose stages are alike an
    earlier one's takes that rank's trace: under torch's runtime (every multi-stage schedule) each
    action's twin on a traced rank, put together in the rank's own order (``comms/composed.py``),
    and under 1F1B its own actions' at fewer microbatches; where a single-stage schedule traces
    every microbatch, the whole rank's (``pipeline/alike.py``). The step needs no process group of
    its own and refuses to run inside one."""
    settings = traced_step_settings(
        "step_comms",
        plan,
        batch=batch,
        seq_len=seq_len,
        optimizer=optimizer,
        activation_checkpointing=activation_checkpointing,
        device=device,
        device_memory=None,
        routing=routing,
    )
    started = time.perf_counter()
    world = plan.context.world
    models = TracedModels(build, plan, alike_layers and world.pp == 1)
    model, index = models.first(), models.index
    flops_per_token = model_flops_per_token(model, seq_len)
    if world.pp == 1:
        if pipeline is not None:
            raise ValueError("pipeline is for a plan with pp above 1; this plan has pp=1")

        def class_comms(group: RankGroup) -> RankClassComms:
            class_started = time.perf_counter()
            if (run := models.run) is not None:
                watches = [CommsWatch(world) for _ in TRACED_DEPTHS]
                models.at_depths(plan, group.first, settings, inputs, watches)
                if (found := extrapolated_class(group, [watch.record for watch in watches], run, class_started)) is not None:
                    return found
            watch = CommsWatch(world)
            models.at_full_depth(plan, group.first, settings, inputs, watch)
            return whole_class(group, watch.record, "the whole model", class_started)

        groups = plan_report(index, plan, optimizer="none").rank_groups
        classes = in_forks(class_comms, groups, tracing_text)
        return StepComms(settings, world, tuple(classes), time.perf_counter() - started, flops_per_token)
    step = pipelined_step(model, replace(plan, index=index), settings, pipeline, inputs)
    classes = _pipelined_classes(model, step, alike_layers)
    return StepComms(step.settings, world, tuple(classes), time.perf_counter() - started, flops_per_token)


def _pipelined_classes(model: nn.Module, step: PipelinedStep, alike_layers: bool) -> list[RankClassComms]:
    """Each rank class's collectives under the pipeline, in the groups' order: the classes
    ``traced_sources`` picks traced side by side; with a list of twins
    (``PipelinedStep.actions_to_put_together``) every class is put together from a traced rank's actions,
    traced at the fewest microbatches that give each rank a twin of every action. Each rank's
    stages are cut from ``model``, which is never planned itself."""
    actions = step.actions_to_put_together() if alike_layers else None
    traced_step = step.traced_step(actions)
    world, places = step.plan.context.world, step.places()
    cut: dict[int, TracedRank] = {}

    def trace(position: int) -> tuple[RankClassComms, Orders | None]:
        started, group = time.perf_counter(), step.groups[position]
        watch = PipelinedCommsWatch(world)
        run_pipelined_fake_step(model, step.plan, traced_step.stages, step.examples, group.first, traced_step.settings, watch)
        return pipelined_class_comms(step, group, watch.record, started), watch.orders

    def answer(position: int, source: int, taken: list[int] | None, whole: RankClassComms) -> RankClassComms:
        if taken is None:
            return whole
        assert actions is not None
        source_cut = cut.setdefault(source, TracedRank.cut(places[source][0], whole.work.timelines[0], actions))
        return put_together_class(step, step.groups[position], source_cut, taken, actions)

    return traced_and_put_together(places, actions, trace, answer, lambda position: tracing_text(step.groups[position]))


def put_together_class(
    step: PipelinedStep, group: RankGroup, source: TracedRank, taken: list[int], actions: RankActions
) -> RankClassComms:
    """``group``'s answer put together from the traced ``source``'s steps, its actions' twins at
    ``taken`` (``RankActions.twin_positions``)."""
    started = time.perf_counter()
    world = step.plan.context.world
    pp_rank = world.coordinates(group.first)[PIPELINE_AXIS]
    timeline = put_together(pp_rank, source, taken, actions, world.stage_size)
    mine, theirs = step.stages.stages_of_rank(pp_rank), step.stages.stages_of_rank(source.pp_rank)
    how = put_together_text(step, actions, mine, theirs)
    return _class_comms(group, collectives_in(timeline.events), how, TracedWork((timeline,)), started)


def _class_comms(
    group: RankGroup, collectives: Sequence[Collective], traced: str, work: TracedWork, started: float
) -> RankClassComms:
    return RankClassComms(group.first, group.count, tuple(collectives), traced, time.perf_counter() - started, work)


def whole_class(group: RankGroup, record: CollectiveRecord, traced: str, started: float) -> RankClassComms:
    """``group``'s answer from its traced rank's record of one whole step."""
    return _class_comms(group, record.collectives(), traced, TracedWork((record.timeline,)), started)


def pipelined_class_comms(step: PipelinedStep, group: RankGroup, record: CollectiveRecord, started: float) -> RankClassComms:
    """``group``'s answer from its traced rank's record under the pipeline."""
    mine = step.stages.stages_of_rank(step.plan.context.world.coordinates(group.first)[PIPELINE_AXIS])
    return whole_class(group, record, f"{stages_text(mine)} whole, under {step.stages.schedule.name}", started)


def extrapolated_class(group: RankGroup, records: list[CollectiveRecord], run: AlikeRun, started: float) -> RankClassComms | None:
    """``group``'s answer from its traced rank's records at the traced depths of ``run``, or
    ``None`` where some collective does not grow by equal steps."""
    full = _extrapolated([record.collectives() for record in records], run)
    if full is None:
        return None
    work = TracedWork(tuple(record.timeline for record in records), run.count)
    return _class_comms(group, full, run.extrapolated_text(), work, started)


def _extrapolated(shallow: list[list[Collective]], run: AlikeRun) -> tuple[Collective, ...] | None:
    """Each collective's calls and bytes at the run's full depth, from the traced depths, or
    ``None`` where some do not grow by equal steps from one depth to the next (extrapolating
    would not be exact). Listed in the order the deepest trace first made each."""
    at = [{collective.key: (collective.count, collective.bytes) for collective in depth} for depth in shallow]
    full = []
    for key in dict.fromkeys(key for depth in reversed(at) for key in depth):
        (calls, size), (calls_one_more, size_one_more), (calls_two_more, size_two_more) = (depth.get(key, (0, 0)) for depth in at)
        if calls_two_more - calls_one_more != calls_one_more - calls or size_two_more - size_one_more != size_one_more - size:
            return None
        blocks = run.count - TRACED_DEPTHS[0]
        count = calls + blocks * (calls_one_more - calls)
        if count:
            full.append(Collective(*key, count, size + blocks * (size_one_more - size)))
    return tuple(full)


class CommsWatch:
    """Step collectives' watch over one traced step (``run_fake_step``'s ``watch``): every
    collective and operator on the record's timeline, each group named by the axes of ``world``,
    and the optimizer step's start marked."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.record = CollectiveRecord(Timeline())

    @contextmanager
    def __call__(self, _model: nn.Module, optimizer: Any, _inputs: Any, mesh_context: MeshContext) -> Iterator[None]:
        with (
            step_errors(lambda: "the model"),
            self.record.naming(GroupAxes(mesh_context, self.world)),
            _marked(optimizer, self.record),
        ):
            yield


class PipelinedCommsWatch:
    """Step collectives' watch over one rank's pipelined step (``run_pipelined_fake_step``'s
    ``watch``): as ``CommsWatch``, with each schedule action, each step of torch's runtime and the
    schedule's end marked; ``orders`` is every rank's runtime list of actions (``None`` for a
    single-stage schedule)."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.record = CollectiveRecord(Timeline())
        self._orders: list[Orders] = []

    @contextmanager
    def __call__(self, _models: Any, optimizer: Any, _inputs: Any, mesh_context: MeshContext, schedule: Any) -> Iterator[None]:
        with (
            step_errors(lambda: "the pipeline's step"),
            self.record.naming(GroupAxes(mesh_context, self.world)),
            _marked(optimizer, self.record),
            _marked_actions(schedule, self.record, self._orders),
        ):
            yield

    @property
    def orders(self) -> Orders:
        return self._orders[0]


@contextmanager
def _marked(optimizer: torch.optim.Optimizer | None, record: CollectiveRecord) -> Iterator[None]:
    """Marks where the optimizer step starts on the record's timeline: it waits for every gradient."""
    if optimizer is None:
        yield
        return
    timeline = record.timeline
    handle = optimizer.register_step_pre_hook(lambda *_: timeline.mark(OPTIMIZER))
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _marked_actions(schedule: Any, record: CollectiveRecord, orders: list[Orders]) -> Iterator[None]:
    """Marks each pipeline action as it starts, each step of torch's runtime, and the schedule's
    end, on the record's timeline; the lists of actions the step runs go to ``orders`` (``actions_run``)."""
    timeline = record.timeline
    on_each_action(
        schedule, lambda stage, kind, microbatch: timeline.mark(kind, stage, microbatch), lambda: timeline.mark(SCHEDULE_END)
    )
    orders.append(actions_run(schedule, marked_runtime_steps(schedule, timeline)))
    yield
