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
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh

from meshbind.errors import StepMemoryError
from meshbind.memory.attention import CudaAttention, real_step_masks
from meshbind.memory.depth import TRACED_DEPTHS, alike_run, extrapolated, kept_modules, truncated
from meshbind.memory.fsdp_chunks import chunks_for_traced_rank
from meshbind.memory.result import RankClassMemory, StepMemory, StepSettings
from meshbind.memory.step import StepInputs, apply_plan, default_inputs, make_optimizer, make_optimizer_state, training_step
from meshbind.memory.trackers import Peak, step_tracker, untracked_shape_propagation
from meshbind.mesh import MeshContext
from meshbind.model_index import ModelIndex
from meshbind.names import ActivationCheckpointing, Checkpointing, Device, Optimizer
from meshbind.report import RankGroup, plan_report
from meshbind.resolution.plan import ParallelPlan
from meshbind.routing import Routing, assuming
from meshbind.world import DENSE_AXES, EXPERT_AXES, World

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
    """
    settings = StepSettings(
        batch=batch,
        seq_len=seq_len,
        optimizer=Optimizer.parse(optimizer, "optimizer"),
        activation_checkpointing=Checkpointing.parse(activation_checkpointing, "activation_checkpointing"),
        device=Device.parse(device, "device"),
        device_memory=device_memory,
        routing=routing if routing is not None else Routing(),
    )
    _check_settings(settings)
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a ParallelPlan (resolve_plan's result), got {type(plan).__name__}")
    if plan.context.world.pp > 1:
        raise StepMemoryError("step_memory does not yet trace pipeline stages: the plan has pp above 1")
    if dist.is_available() and dist.is_initialized():
        raise StepMemoryError(
            "step_memory traces over torch's fake process group and cannot while a process group is "
            "initialised: call it before init_process_group, or in a process of its own"
        )
    started = time.perf_counter()
    models = _Models(build, plan, alike_layers)
    groups = plan_report(models.index, plan, optimizer="none").rank_groups
    classes = [_trace_class(models, plan, group, settings, inputs) for group in groups]
    return StepMemory(settings, plan.context.world, tuple(classes), time.perf_counter() - started)


class _Models:
    """The models the traces apply the plan to, each its own: the model first built (once), a
    copy of it at each traced depth, and a new build where a whole model is traced again."""

    def __init__(self, build: Callable[[], nn.Module], plan: ParallelPlan, alike_layers: bool) -> None:
        self.build = build
        with torch.device("meta"):
            self.unused: nn.Module | None = build()
        assert self.unused is not None
        self.index = plan.index if plan.index is not None else ModelIndex.of(self.unused)
        self.run = alike_run(self.index) if alike_layers else None
        self.deepest = truncated(self.unused, self.run, TRACED_DEPTHS[-1]) if self.run is not None else None

    def kept(self, blocks: int) -> nn.Module:
        assert self.run is not None and self.deepest is not None
        return truncated(self.deepest, self.run, blocks)

    def whole(self) -> nn.Module:
        if self.unused is not None:
            model, self.unused = self.unused, None
            return model
        with torch.device("meta"):
            return self.build()


def _trace_class(
    models: _Models, plan: ParallelPlan, group: RankGroup, settings: StepSettings, inputs: StepInputs | None
) -> RankClassMemory:
    """One rank of ``group`` traced: at three depths of the alike run when that is exact, else whole."""
    started = time.perf_counter()
    run = models.run
    if run is not None:
        traced = []
        for kept in TRACED_DEPTHS:
            model, keep = models.kept(kept), kept_modules(run, kept)
            shallower = replace(plan.only(keep), index=models.index.restricted(model, keep))
            traced.append(_trace_rank(model, shallower, group.first, settings, inputs, run.list_fqn))
        found = extrapolated([peak.places for peak in traced], run)
        if found is not None:
            (module, phase, _), full = found
            depths = ", ".join(map(str, TRACED_DEPTHS[:-1])) + f" and {TRACED_DEPTHS[-1]}"
            return RankClassMemory(
                first_rank=group.first,
                ranks=group.count,
                peak_bytes=full.pop("peak"),
                live_at_peak=full,
                peak_module=module,
                peak_phase=phase,
                traced=f"{depths} of the {run.count} alike blocks of {run.list_fqn}, extrapolated (exact)",
                seconds=time.perf_counter() - started,
            )
    model = models.whole()
    whole_plan = replace(plan, index=models.index.restricted(model))
    peak = _trace_rank(model, whole_plan, group.first, settings, inputs, models.index.layer_list())
    return RankClassMemory(
        first_rank=group.first,
        ranks=group.count,
        peak_bytes=peak.total,
        live_at_peak=peak.kinds,
        peak_module=peak.module,
        peak_phase=peak.phase,
        traced="the whole model",
        seconds=time.perf_counter() - started,
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


def _check_settings(settings: StepSettings) -> None:
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


@contextmanager
def _fake_world(rank: int, world: World) -> Iterator[MeshContext]:
    """The default group replaced by torch's fake one for ``rank``, and both meshes over it (the
    expert mesh even at ``ep`` 1: expert modules bind over one-rank groups there)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world.size)
    try:
        yield MeshContext(_rank_mesh(rank, world.dense_shape, DENSE_AXES), _rank_mesh(rank, world.expert_shape, EXPERT_AXES))
    finally:
        dist.destroy_process_group()


def _rank_mesh(rank: int, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A device mesh of ``shape`` over the fake group holding only ``rank``'s own group along each
    dim: ``init_device_mesh`` would make every group of every dim, a million at a million ranks."""
    ranks = torch.arange(math.prod(shape)).view(shape)
    coordinate = torch.unravel_index(torch.tensor(rank), shape)
    groups: list[dist.ProcessGroup] = []
    for dim in range(len(shape)):
        along = ranks[tuple(slice(None) if index == dim else int(coordinate[index]) for index in range(len(shape)))]
        group = dist.new_group(along.tolist(), use_local_synchronization=True)
        assert isinstance(group, dist.ProcessGroup)  # the rank is in every group made here
        groups.append(group)
    return DeviceMesh.from_group(groups, "cpu", mesh=ranks, mesh_dim_names=names)


@contextmanager
def _without_torch_advice() -> Iterator[None]:
    """torch.distributed's warnings are for the user's own run, which will give them again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
        yield


def _trace_rank(
    model: nn.Module, plan: ParallelPlan, rank: int, settings: StepSettings, inputs: StepInputs | None, blocks: str | None
) -> Peak:
    with _without_torch_advice(), chunks_for_traced_rank(), _fake_world(rank, plan.context.world) as mesh_context:
        on_device = CudaAttention if settings.device is Device.CUDA else contextlib.nullcontext
        apply_plan(model, plan, mesh_context, settings.activation_checkpointing, on_device)
        step_inputs = inputs or default_inputs(model)
        with FakeTensorMode(allow_non_fake_inputs=True), assuming(settings.routing), on_device(), real_step_masks():
            model.to_empty(device="cpu")
            optimizer = make_optimizer(model, settings.optimizer, settings.device)
            make_optimizer_state(optimizer)
            args, kwargs = step_inputs(settings.batch, settings.seq_len)
            tracker = step_tracker(model, optimizer, (args, kwargs), blocks)
            try:
                with tracker, untracked_shape_propagation(tracker):
                    training_step(model, optimizer, args, kwargs)
            except StepMemoryError:
                raise
            except Exception as error:
                raise StepMemoryError(_untraceable(error, tracker)) from error
    return tracker.peak()


def _untraceable(error: Exception, tracker: Any) -> str:
    where = tracker.current_module() or "the model"
    return (
        f"one training step cannot be traced with fake tensors: {where} ({tracker.current_phase()}) raised "
        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    )
