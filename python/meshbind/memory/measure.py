"""The truth a step-memory estimate is checked against: one real training step on this rank,
measured by the CPU allocator's own record of every allocation and free (``torch.profiler`` with
``profile_memory=True``). It shares no counting with the trace: no fake tensor, no memory tracker.

The profiler's allocation events are read in time order (its op tree) rather than through its
categorised memory timeline, whose data-flow graph fails now and then on steps with collectives
("duplicate outputs"); what existed before the step is added from the tensors themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import OpTree
from torch.utils._pytree import tree_leaves

from meshbind.memory.step import training_step


def measured_step_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    """The most bytes live on the CPU at once during one ``training_step``: what existed before it
    (parameters, buffers, optimizer state, the inputs) and what the step allocated and not yet freed."""
    before = _storage_bytes(_existing_tensors(model, optimizer, (args, kwargs)))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        training_step(model, optimizer, args, kwargs)
    assert profiled.profiler is not None and profiled.profiler.kineto_results is not None
    live = peak = 0
    for node in OpTree(profiled.profiler.kineto_results).sorted_nodes:
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu":
            live += node.typed[1].alloc_size
            peak = max(peak, live)
    return before + peak


def _existing_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None, inputs: Any) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))
    yield from (leaf for leaf in tree_leaves(inputs) if isinstance(leaf, torch.Tensor))


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Each storage once: a DTensor's local shard's, a view's whole base's."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.device.type == "cpu":
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
