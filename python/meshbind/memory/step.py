"""The training step a trace and a measurement both run, on a model the plan was applied to as a
training job applies it; what a forward call takes; the optimizer and its state."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor

from meshbind.activation_checkpointing import RecomputeContext, apply_checkpointing
from meshbind.appliers import apply_parallelism
from meshbind.errors import StepMemoryError
from meshbind.fsdp import apply_fully_shard
from meshbind.mesh import MeshContext
from meshbind.names import Checkpointing, Device, Optimizer
from meshbind.resolution.plan import ParallelPlan

StepInputs = Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]
"""``inputs(batch, seq_len)`` → the positional and keyword arguments of one forward call."""


def apply_plan(
    model: nn.Module,
    plan: ParallelPlan,
    mesh_context: MeshContext,
    checkpointing: Checkpointing,
    recompute_context: RecomputeContext | None = None,
) -> None:
    """The plan applied as a training job applies it: layouts and binding by the applier of the
    plan's source (``appliers.apply_parallelism``), activation checkpointing
    (``activation_checkpointing.apply_checkpointing``, with ``recompute_context``), then FSDP."""
    apply_parallelism(model, plan, mesh_context)
    apply_checkpointing(model, plan, checkpointing, recompute_context)
    if plan.fsdp is not None:
        apply_fully_shard(model, plan, mesh_context)


def default_inputs(model: nn.Module) -> StepInputs:
    """Token ids as ``input_ids=``/``labels=`` (and ``use_cache=False``) for a forward that takes
    ``input_ids``, else as two positional arguments. Zeros: a fake tensor's values are never read."""
    taken = inspect.signature(model.forward).parameters
    # Training keeps no key/value cache (a recomputed layer would append to it twice).
    no_cache = {"use_cache": False} if "use_cache" in taken else {}

    def inputs(batch: int, seq_len: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = torch.zeros(batch, seq_len, dtype=torch.long)
        if "input_ids" in taken:
            return (), {"input_ids": ids, "labels": ids.clone(), **no_cache}
        return (ids, ids.clone()), {}

    return inputs


def make_optimizer(model: nn.Module, name: Optimizer, device: Device) -> torch.optim.Optimizer | None:
    """The optimizer torch would run on ``device``: foreach on CUDA (torch's default there, whose
    grouped temporaries count) unless the parameters mix DTensors and plain tensors, one parameter
    at a time on the CPU."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    # torch's foreach kernels take a list of one kind: DTensors, or plain tensors.
    foreach = device == Device.CUDA and len({isinstance(p, DTensor) for p in parameters}) == 1
    if name == Optimizer.SGD_MOMENTUM:
        return torch.optim.SGD(parameters, lr=0.01, momentum=0.9, foreach=foreach)
    if name == Optimizer.ADAM:
        return torch.optim.Adam(parameters, lr=0.01, foreach=foreach)
    return None


def make_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """The optimizer's state as it is at every step after the first: made by one step on zero
    gradients, the gradients then dropped."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def training_step(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Forward, backward, optimizer step, gradients dropped: the step both the trace and a real
    measurement run."""
    output = model(*args, **kwargs)
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise StepMemoryError(
            f"{type(model).__name__}.forward must return the loss (a 0-d tensor) or an output with a .loss; "
            f"got {type(output).__name__}"
        )
    loss.backward()  # type: ignore[no-untyped-call]
    del output, loss
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def pipelined_training_step(
    schedule: _PipelineSchedule,
    optimizer: torch.optim.Optimizer | None,
    tokens: torch.Tensor | None,
    targets: torch.Tensor | None,
) -> None:
    """One step of torch's pipeline schedule over this rank's stages (the rank of the first stage
    given the batch's inputs, the rank of the last its targets), then the optimizer step, gradients
    dropped: the pipelined step both the trace and a real measurement run."""
    schedule.step(*(() if tokens is None else (tokens,)), target=targets)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
