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
from meshbind.memory.result import StepSettings
from meshbind.memory.step import StepInputs
from meshbind.memory.trace import check_settings
from meshbind.mesh import MeshContext
from meshbind.model_index import ModelIndex
from meshbind.names import ActivationCheckpointing, Checkpointing, Device, Optimizer
from meshbind.report import plan_report
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
) -> StepComms:
    """Every collective one training step (forward, backward, optimizer step) issues on each class
    of ranks: its kind, the mesh axes of its group and the group's size, the dtype, the calls and
    their bytes (as nccl-tests sizes them; ``comms/record.py``).

    ``build``, ``plan``, ``batch``, ``seq_len``, ``inputs`` and the settings are ``step_memory``'s,
    and the step is the one it traces: FSDP2's all-gathers and reduce-scatters (HSDP's all-reduce
    too), TP's and sequence parallelism's, CP's and EP's all-to-all under the same ``routing``.
    Each class's model is traced whole; the step needs no process group of its own and refuses to
    run inside one. A pipeline (``pp`` above 1) is not traced yet: a ``ValueError``."""
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
    if plan.context.world.pp > 1:
        raise ValueError(f"step_comms does not trace a pipeline yet; this plan has pp={plan.context.world.pp}")
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
    unplanned: nn.Module | None = model
    for group in plan_report(index, plan, optimizer="none").rank_groups:
        class_started = time.perf_counter()
        if unplanned is None:  # the plan was applied to the last one: each class builds its own
            with torch.device("meta"):
                unplanned = build()
        recorded = _record_rank(unplanned, replace(plan, index=index.restricted(unplanned)), group.first, settings, inputs)
        unplanned = None
        seconds = time.perf_counter() - class_started
        classes.append(RankClassComms(group.first, group.count, tuple(recorded.collectives()), seconds))
    return StepComms(settings, plan.context.world, tuple(classes), time.perf_counter() - started)


def _record_rank(
    model: nn.Module, plan: ParallelPlan, rank: int, settings: StepSettings, inputs: StepInputs | None
) -> CollectiveRecord:
    records: list[CollectiveRecord] = []

    @contextmanager
    def recorded(_model: nn.Module, _optimizer: Any, _inputs: Any, mesh_context: MeshContext) -> Iterator[None]:
        records.append(CollectiveRecord(GroupAxes(mesh_context, plan.context.world, rank)))
        with step_errors(lambda: "the model"), records[0]:
            yield

    run_fake_step(model, plan, rank, settings, inputs, recorded)
    return records[0]
