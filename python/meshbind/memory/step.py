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


def make_optimizer(
    model: nn.Module, name: Optimizer, device: Device, *, on_local_shards: bool = False
) -> torch.optim.Optimizer | None:
    """The optimizer torch would run on ``device``: foreach on CUDA (torch's default there, whose
    grouped temporaries count) unless the parameters mix DTensors and plain tensors, one parameter
    at a time on the CPU.

    With ``on_local_shards`` (the traces), a foreach optimizer over DTensor parameters steps their
    local shards instead: a DTensor foreach step runs the same foreach kernels on the same local
    tensors, so it makes the same bytes (tested against torch's DTensor step), while torch's
    sharding propagation of each foreach call, element by element, took a third of a trace."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    # torch's foreach kernels take a list of one kind: DTensors, or plain tensors.
    kinds = {isinstance(p, DTensor) for p in parameters}
    foreach = device == Device.CUDA and len(kinds) == 1
    optimizer_class: type[torch.optim.Optimizer]
    settings: dict[str, Any]
    if name == Optimizer.SGD_MOMENTUM:
        optimizer_class, settings = torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "foreach": foreach}
    elif name == Optimizer.ADAM:
        optimizer_class, settings = torch.optim.Adam, {"lr": 0.01, "foreach": foreach}
    else:
        return None
    if not (on_local_shards and foreach and kinds == {True}):
        return optimizer_class(parameters, **settings)
    dtensors: list[DTensor] = [p for p in parameters if isinstance(p, DTensor)]
    stepping = type(f"{optimizer_class.__name__}OnLocalShards", (_OnLocalShards, optimizer_class), {})
    optimizer: _OnLocalShards = stepping([p._local_tensor for p in dtensors], **settings)
    optimizer.dtensors = dtensors
    optimizer.register_step_pre_hook(_bind_gradients)
    optimizer.register_step_post_hook(_unbind_gradients)
    return optimizer


class _OnLocalShards(torch.optim.Optimizer):
    """Mixed before a torch optimizer made over DTensor parameters' local shards (``dtensors``, in
    the order of its parameters): each step reads the DTensors' gradients' local tensors (views:
    no bytes), and dropping the gradients drops the DTensors' too."""

    dtensors: list[DTensor]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for dtensor in self.dtensors:
            dtensor.grad = None


def _shards(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [shard for group in optimizer.param_groups for shard in group["params"]]


def _bind_gradients(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    assert isinstance(optimizer, _OnLocalShards)
    for dtensor, shard in zip(optimizer.dtensors, _shards(optimizer), strict=True):
        if isinstance(dtensor.grad, DTensor):
            shard.grad = dtensor.grad._local_tensor


def _unbind_gradients(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for shard in _shards(optimizer):
        shard.grad = None


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
    dropped: the pipelined step both the trace and a real measurement run. As torchtitan runs it,
    the schedule returns no outputs: the last stage keeps no microbatch's logits to merge."""
    schedule.step(*(() if tokens is None else (tokens,)), target=targets, return_outputs=False)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
