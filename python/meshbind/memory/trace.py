"""One training step of the planned model, traced: torch's ``FakeTensorMode`` holds no data, torch's
fake process group runs no collective, and torch's memory trackers (``MemTracker``, or
``FSDPMemTracker`` under FSDP) count every storage the step allocates and frees.

The plan is really applied, as on a real rank: layouts (TP/EP DTensors), binding (CP/EP
contexts), activation checkpointing (torch's ``checkpoint_wrapper``) and FSDP2 (torch's
``fully_shard``), on meshes of the world's shape over the fake group. Only one rank is traced per
class of ranks holding alike shards (``plan_report``'s rank groups).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshbind.errors import StepMemoryError
from meshbind.forks import in_forks
from meshbind.memory.composed import module_mover, put_together
from meshbind.memory.depth import TRACED_DEPTHS, AlikeRun, alike_run, depth_copies, extrapolated, truncated
from meshbind.memory.fake_step import Watch, run_fake_step
from meshbind.memory.pipelined import PipelinedMemoryWatch, PipelinedStep, pipelined_step, run_pipelined_fake_step
from meshbind.memory.result import RankClassMemory, StepMemory, StepSettings
from meshbind.memory.step import StepInputs
from meshbind.memory.trackers import Peak, StepPart, step_tracker, traced_step
from meshbind.model_index import ModelIndex
from meshbind.names import ActivationCheckpointing, Checkpointing, Device, Optimizer
from meshbind.pipeline import Pipeline, stages_text
from meshbind.pipeline.runtime import Orders, RankActions, traced_and_put_together
from meshbind.report import RankGroup, plan_report
from meshbind.resolution.plan import ParallelPlan
from meshbind.routing import Routing
from meshbind.world import PIPELINE_AXIS

TRACED_OPTIMIZERS = (Optimizer.NONE, Optimizer.SGD_MOMENTUM, Optimizer.ADAM)
"""The optimizers a trace steps (a float32 master copy is the mixed-precision issue's)."""


def step_memory(
    build: Callable[[], nn.Module],
    plan: ParallelPlan,
    *,
    batch: int,
    seq_len: int,
    optimizer: str = Optimizer.ADAM,
    activation_checkpointing: str | Checkpointing = ActivationCheckpointing.NONE,
    device: str = Device.CUDA,
    device_memory: int | None = None,
    routing: Routing | None = None,
    inputs: StepInputs | None = None,
    alike_layers: bool = True,
    pipeline: Pipeline | None = None,
) -> StepMemory:
    """The peak bytes of one training step (forward, backward, optimizer step) on each class of
    ranks, with what is live at the peak and where it falls.

    ``build()`` makes the model (called under ``torch.device("meta")``, once per traced rank);
    ``plan`` is ``resolve_plan``'s for a model ``build()`` makes, applied to each traced model as
    it is: never resolved again, and its index (``resolve_plan(..., index=True)``; else one walk
    of the first model built) stands for every model built, and is cut to each shallower copy.
    ``batch`` is the sequences of one data-parallel rank, ``seq_len`` their length.
    ``inputs(batch, seq_len)`` gives one forward call's arguments; by default token ids
    ``[batch, seq_len]`` are passed as ``input_ids=`` and ``labels=`` (with ``use_cache=False``)
    when ``forward`` takes ``input_ids``, else as two positional arguments (the ids and the
    targets). The output is the loss, or has a ``.loss``.

    The step is traced with no weights and no collectives; it needs no process group of its own
    and refuses to run inside one (a fake group takes the default group's place while tracing).
    With ``alike_layers`` (the default), a model whose blocks end in more than five alike ones is
    traced at three, four and five of them, under the plan of the modules each copy keeps, and
    extrapolated where that is exact (``memory/depth.py``), else traced whole.

    With ``pp`` above 1, ``pipeline`` (default ``Pipeline()``: 1F1B, a microbatch per stage)
    splits the model, and each class of ranks runs its stages' whole step under torch's schedule
    (``memory/pipelined.py``): ``batch`` splits into the microbatches, the first stage takes the
    token ids and the last stage's output gives the loss (``pipeline.stage_loss``).
    """
    settings = traced_step_settings(
        "step_memory",
        plan,
        batch=batch,
        seq_len=seq_len,
        optimizer=optimizer,
        activation_checkpointing=activation_checkpointing,
        device=device,
        device_memory=device_memory,
        routing=routing,
    )
    started = time.perf_counter()
    # Under a pipeline each stage is traced whole: no shallower copies are cut.
    models = TracedModels(build, plan, alike_layers and plan.context.world.pp == 1)
    if plan.context.world.pp == 1:
        if pipeline is not None:
            raise ValueError("pipeline is for a plan with pp above 1; this plan has pp=1")
        groups = plan_report(models.index, plan, optimizer="none").rank_groups
        classes = in_forks(lambda group: _trace_class(models, plan, group, settings, inputs), groups, tracing_text)
        return StepMemory(settings, plan.context.world, tuple(classes), time.perf_counter() - started)
    whole = models.first()
    step = pipelined_step(whole, replace(plan, index=models.index), settings, pipeline, inputs)
    classes = _pipelined_classes(whole, step, alike_layers)
    return StepMemory(step.settings, plan.context.world, tuple(classes), time.perf_counter() - started)


class TracedModels:
    """The models the traces apply the plan to, each its own: the model first built (once here,
    once in each fork), a copy of it at each traced depth, and a new build where a whole model is
    traced again."""

    def __init__(self, build: Callable[[], nn.Module], plan: ParallelPlan, alike_layers: bool) -> None:
        self.build = build
        with torch.device("meta"):
            self.unused: nn.Module | None = build()
        assert self.unused is not None
        self.index = plan.index if plan.index is not None else ModelIndex.of(self.unused)
        self.run = alike_run(self.index) if alike_layers else None
        self.deepest = truncated(self.unused, self.run, TRACED_DEPTHS[-1]) if self.run is not None else None

    def first(self) -> nn.Module:
        """The model first built, which a pipeline's stages are cut from (each a copy)."""
        assert self.unused is not None
        return self.unused

    def whole(self) -> nn.Module:
        if self.unused is not None:
            model, self.unused = self.unused, None
            return model
        with torch.device("meta"):
            return self.build()

    def at_depths(
        self, plan: ParallelPlan, rank: int, settings: StepSettings, inputs: StepInputs | None, watches: Sequence[Watch]
    ) -> None:
        """One step of ``rank`` on the copy at each traced depth of the alike run, under its own
        plan (``depth_copies``), each watched by the watch of its depth."""
        assert self.run is not None and self.deepest is not None
        for (model, shallower), watch in zip(depth_copies(self.deepest, plan, self.index, self.run), watches, strict=True):
            run_fake_step(model, shallower, rank, settings, inputs, watch)

    def at_full_depth(
        self, plan: ParallelPlan, rank: int, settings: StepSettings, inputs: StepInputs | None, watch: Watch
    ) -> None:
        """One step of ``rank`` on a whole model, watched by ``watch``."""
        model = self.whole()
        run_fake_step(model, replace(plan, index=self.index.restricted(model)), rank, settings, inputs, watch)


def _trace_class(
    models: TracedModels, plan: ParallelPlan, group: RankGroup, settings: StepSettings, inputs: StepInputs | None
) -> RankClassMemory:
    """One rank of ``group`` traced: at three depths of the alike run when that is exact, else whole."""
    started = time.perf_counter()
    if (run := models.run) is not None:
        watches = [MemoryWatch(run.list_fqn) for _ in TRACED_DEPTHS]
        models.at_depths(plan, group.first, settings, inputs, watches)
        if (found := extrapolated_class(group, [watch.peak() for watch in watches], run, started)) is not None:
            return found
    watch = MemoryWatch(models.index.layer_list())
    models.at_full_depth(plan, group.first, settings, inputs, watch)
    return class_memory(group, watch.peak(), "the whole model", started)


def extrapolated_class(group: RankGroup, shallow_peaks: list[Peak], run: AlikeRun, started: float) -> RankClassMemory | None:
    """``group``'s answer from its traced rank's peaks at the traced depths of ``run``, or ``None``
    where some place does not grow by equal steps (``memory/depth.py``)."""
    found = extrapolated([peak.places for peak in shallow_peaks], run)
    if found is None:
        return None
    (module, phase, _), full = found
    return class_memory(group, Peak(full.pop("peak"), full, module, phase, {}, ""), run.extrapolated_text(), started)


def _pipelined_classes(whole: nn.Module, step: PipelinedStep, alike_layers: bool) -> list[RankClassMemory]:
    """Each rank class's step memory under the pipeline, in the groups' order. With ``alike_layers``
    and a list of twins (``PipelinedStep.actions_to_put_together``: every multi-stage schedule, 1F1B over
    more than ``pp + 2`` microbatches, GPipe), the classes ``traced_sources`` picks are traced, side
    by side, at the fewest microbatches that give each rank a twin of every action, and every class
    is put together from a traced rank's actions (``memory/composed.py``); else each class is
    traced, side by side. Each rank's stages are cut from ``whole``, which is never planned itself."""

    Traced = tuple[RankClassMemory, list[StepPart]]  # the class's answer, and its step's parts
    actions = step.actions_to_put_together() if alike_layers else None
    traced_step = step.traced_step(actions)

    def trace(position: int) -> tuple[Traced, Orders | None]:
        started, group = time.perf_counter(), step.groups[position]
        watch = PipelinedMemoryWatch(step.plan)
        run_pipelined_fake_step(whole, step.plan, traced_step.stages, step.examples, group.first, traced_step.settings, watch)
        return (pipelined_class_memory(step, group, watch.peak(), started), watch.parts()), watch.orders

    def answer(position: int, source: int, taken: list[int] | None, traced: Traced) -> RankClassMemory:
        if taken is None:
            return traced[0]
        assert actions is not None
        return put_together_class(step, step.groups[position], step.groups[source], traced[1], taken, actions)

    return traced_and_put_together(step.places(), actions, trace, answer, lambda position: tracing_text(step.groups[position]))


def put_together_class(
    step: PipelinedStep, group: RankGroup, source: RankGroup, parts: list[StepPart], taken: list[int], actions: RankActions
) -> RankClassMemory:
    """``group``'s answer put together from the traced ``source``'s ``parts``, its actions' twins
    at ``taken`` (``RankActions.twin_positions``) in its own order."""
    started = time.perf_counter()
    world = step.plan.context.world
    pp_rank, source_rank = world.coordinates(group.first)[PIPELINE_AXIS], world.coordinates(source.first)[PIPELINE_AXIS]
    mine, theirs = step.stages.stages_of_rank(pp_rank), step.stages.stages_of_rank(source_rank)
    more_inputs = step.inputs_bytes(pp_rank) - step.traced_step(actions).inputs_bytes(pp_rank)
    peak = put_together(parts, taken, actions.orders[pp_rank], module_mover(step.stages, theirs, mine), more_inputs)
    return class_memory(group, peak, put_together_text(step, actions, mine, theirs), started, mine)


def put_together_text(step: PipelinedStep, actions: RankActions, mine: tuple[int, ...], theirs: tuple[int, ...]) -> str:
    """How a rank's answer put together from a traced rank's actions was found (``traced``)."""
    if actions.traced is None:
        return f"{stages_text(mine)}: {stages_text(theirs)}' actions, put together"
    whose = "their own" if mine == theirs else f"{stages_text(theirs)}'"
    fewer, all_of_them = actions.traced.stages.microbatches, step.stages.microbatches
    return f"{stages_text(mine)}: {whose} actions in a step of {fewer} of its {all_of_them} microbatches, put together"


def pipelined_class_memory(step: PipelinedStep, group: RankGroup, peak: Peak, started: float) -> RankClassMemory:
    """``group``'s answer from its traced rank's peak under the pipeline."""
    mine = step.stages.stages_of_rank(step.plan.context.world.coordinates(group.first)[PIPELINE_AXIS])
    return class_memory(group, peak, f"{stages_text(mine)} whole, under {step.stages.schedule.name}", started, mine)


def tracing_text(group: RankGroup) -> str:
    """What a trace of ``group``'s rank is doing, for a child that ends without an answer (``in_forks``)."""
    return f"tracing rank {group.first}'s step"


def class_memory(group: RankGroup, peak: Peak, traced: str, started: float, stages: tuple[int, ...] = ()) -> RankClassMemory:
    """The answer for ``group`` from its traced rank's peak (``started``: when its tracing began)."""
    return RankClassMemory(
        first_rank=group.first,
        ranks=group.count,
        peak_bytes=peak.total,
        live_at_peak=peak.kinds,
        peak_module=peak.module,
        peak_phase=peak.phase,
        traced=traced,
        seconds=time.perf_counter() - started,
        stages=stages,
        peak_action=peak.action,
    )


MAX_TOKENS = 2**31 - 1
"""The most tokens one rank's batch may hold (``batch * seq_len``): torch indexes a tensor's
elements in 32 bits in many CPU and CUDA kernels, and a step past it is no real step."""


def step_size_problem(batch: int, seq_len: int, names: tuple[str, str] = ("batch", "seq_len")) -> str | None:
    """Why a step of ``batch`` sequences of ``seq_len`` tokens cannot be traced, each size called
    by ``names`` (the command line's flags, or the arguments); ``None`` when it can."""
    for name, value in zip(names, (batch, seq_len), strict=True):
        if value > MAX_TOKENS:
            return f"{name} {value} is over the limit of {MAX_TOKENS:,} (2**31 - 1)"
    if batch * seq_len > MAX_TOKENS:
        return (
            f"{names[0]} {batch} x {names[1]} {seq_len} is {batch * seq_len:,} tokens per rank, over the limit of {MAX_TOKENS:,}"
        )
    return None


def traced_step_settings(
    traced_by: str,
    plan: ParallelPlan,
    *,
    batch: int,
    seq_len: int,
    optimizer: str,
    activation_checkpointing: str | Checkpointing,
    device: str,
    device_memory: int | None,
    routing: Routing | None,
) -> StepSettings:
    """The settings of the step ``traced_by`` (``step_memory``, ``step_comms``) traces for ``plan``,
    each checked (a ``ValueError`` or ``TypeError`` naming the argument); a ``StepMemoryError``
    while a process group is initialised, as the trace runs over torch's fake one."""
    settings = StepSettings(
        batch=batch,
        seq_len=seq_len,
        optimizer=Optimizer.parse(optimizer, "optimizer"),
        activation_checkpointing=Checkpointing.parse(activation_checkpointing, "activation_checkpointing"),
        device=Device.parse(device, "device"),
        device_memory=device_memory,
        routing=routing if routing is not None else Routing(),
    )
    for name in ("batch", "seq_len"):
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if (problem := step_size_problem(settings.batch, settings.seq_len)) is not None:
        raise ValueError(problem)
    if settings.optimizer not in TRACED_OPTIMIZERS:
        raise ValueError(f"the traced optimizer must be one of {', '.join(TRACED_OPTIMIZERS)}, got {settings.optimizer.value!r}")
    if settings.device_memory is not None and (not isinstance(settings.device_memory, int) or settings.device_memory < 1):
        raise ValueError(f"device_memory must be a positive number of bytes, got {settings.device_memory!r}")
    if not isinstance(settings.routing, Routing):
        raise TypeError(f"routing must be a Routing, got {type(settings.routing).__name__}")
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a ParallelPlan (resolve_plan's result), got {type(plan).__name__}")
    if dist.is_available() and dist.is_initialized():
        raise StepMemoryError(
            f"{traced_by} traces over torch's fake process group and cannot while a process group is "
            "initialised: call it before init_process_group, or in a process of its own"
        )
    return settings


class MemoryWatch:
    """Step memory's watch over one traced step (``run_fake_step``'s ``watch``): torch's trackers,
    counting from the step's start; ``blocks`` is the model's layer list, if any (``Place``)."""

    def __init__(self, blocks: str | None) -> None:
        self.blocks = blocks
        self._trackers: list[Any] = []

    @contextlib.contextmanager
    def __call__(self, model: nn.Module, optimizer: Any, step_inputs: Any, _: Any) -> Iterator[None]:
        self._trackers.append(step_tracker([model], optimizer, step_inputs, self.blocks))
        with traced_step(self._trackers[0]):
            yield

    def peak(self) -> Peak:
        """The traced step's peak, where it falls and each place's most bytes."""
        peak: Peak = self._trackers[0].peak()
        return peak
