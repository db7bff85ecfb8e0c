"""Every collective of one training step of the planned model, traced: the step runs as step
memory runs it (``memory/fake_step.py``: the plan really applied over torch's fake process group,
fake tensors), and each collective it dispatches is counted (``comms/record.py``). One rank is
traced per class of ranks holding alike shards (``plan_report``'s rank groups)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshbind.comms.record import CollectiveRecord, GroupAxes
from meshbind.comms.result import RankClassComms, StepComms
from meshbind.errors import StepMemoryError
from meshbind.memory.fake_step import run_fake_step, step_errors
from meshbind.memory.pipelined import PipelinedStep, pipelined_step, run_pipelined_fake_step
from meshbind.memory.result import StepSettings
from meshbind.memory.step import StepInputs
from meshbind.memory.trace import check_settings
from meshbind.mesh import MeshContext
from meshbind.model_index import ModelIndex
from meshbind.names import ActivationCheckpointing, Checkpointing, Device, Optimizer
from meshbind.pipeline import Pipeline
from meshbind.report import RankGroup, plan_report
from meshbind.resolution.plan import ParallelPlan
from meshbind.routing import Routing


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
) -> StepComms:
    """Every collective one training step (forward, backward, optimizer step) issues on each class
    of ranks: its kind, the mesh axes of its group and the group's size, the dtype, the calls and
    their bytes (as nccl-tests sizes them; ``comms/record.py``).

    ``build``, ``plan``, ``batch``, ``seq_len``, ``inputs`` and the settings are ``step_memory``'s,
    and the step is the one it traces: FSDP2's all-gathers and reduce-scatters (HSDP's all-reduce
    too), TP's and sequence parallelism's, CP's and EP's all-to-all under the same ``routing``.
    Under a pipeline (``pp`` above 1, ``pipeline`` as ``step_memory`` takes it) each class runs its
    stages' step under torch's schedule, and the stages' sends and receives are counted too. Each
    class's model is traced whole; the step needs no process group of its own and refuses to run
    inside one."""
    settings = StepSettings(
        batch=batch,
        seq_len=seq_len,
        optimizer=Optimizer.parse(optimizer, "optimizer"),
        activation_checkpointing=Checkpointing.parse(activation_checkpointing, "activation_checkpointing"),
        device=Device.parse(device, "device"),
        device_memory=None,
        routing=routing if routing is not None else Routing(),
    )
    check_settings(settings)
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a ParallelPlan (resolve_plan's result), got {type(plan).__name__}")
    if dist.is_available() and dist.is_initialized():
        raise StepMemoryError(
            "step_comms traces over torch's fake process group and cannot while a process group is "
            "initialised: call it before init_process_group, or in a process of its own"
        )
    started = time.perf_counter()
    with torch.device("meta"):
        model = build()
    index = plan.index if plan.index is not None else ModelIndex.of(model)
    classes = []
    if plan.context.world.pp == 1:
        if pipeline is not None:
            raise ValueError("pipeline is for a plan with pp above 1; this plan has pp=1")
        unplanned: nn.Module | None = model
        for group in plan_report(index, plan, optimizer="none").rank_groups:
            class_started = time.perf_counter()
            if unplanned is None:  # the plan was applied to the last one: each class builds its own
                with torch.device("meta"):
                    unplanned = build()
            recorded = _record_rank(unplanned, replace(plan, index=index.restricted(unplanned)), group.first, settings, inputs)
            unplanned = None
            classes.append(_class_comms(group, recorded, class_started))
        return StepComms(settings, plan.context.world, tuple(classes), time.perf_counter() - started)
    step = pipelined_step(model, replace(plan, index=index), settings, pipeline, inputs)
    for group in step.groups:  # each rank's stages are cut from the model: it is never planned itself
        class_started = time.perf_counter()
        recorded = _record_pipelined_rank(model, step, group.first)
        classes.append(_class_comms(group, recorded, class_started))
    return StepComms(step.settings, plan.context.world, tuple(classes), time.perf_counter() - started)


def _class_comms(group: RankGroup, recorded: CollectiveRecord, started: float) -> RankClassComms:
    return RankClassComms(group.first, group.count, tuple(recorded.collectives()), time.perf_counter() - started)


def _record_rank(
    model: nn.Module, plan: ParallelPlan, rank: int, settings: StepSettings, inputs: StepInputs | None
) -> CollectiveRecord:
    record = CollectiveRecord()

    @contextmanager
    def recorded(_model: nn.Module, _optimizer: Any, _inputs: Any, mesh_context: MeshContext) -> Iterator[None]:
        with step_errors(lambda: "the model"), record.naming(GroupAxes(mesh_context, plan.context.world, rank)):
            yield

    run_fake_step(model, plan, rank, settings, inputs, recorded)
    return record


def _record_pipelined_rank(whole: nn.Module, step: PipelinedStep, rank: int) -> CollectiveRecord:
    record = CollectiveRecord()

    @contextmanager
    def recorded(_models: Any, _optimizer: Any, _inputs: Any, mesh_context: MeshContext, _schedule: Any) -> Iterator[None]:
        with step_errors(lambda: "the pipeline's step"), record.naming(GroupAxes(mesh_context, step.plan.context.world, rank)):
            yield

    run_pipelined_fake_step(whole, step.plan, step.stages, step.examples, rank, step.settings, recorded)
    return record
