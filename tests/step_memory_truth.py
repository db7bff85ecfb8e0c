"""The truth a step-memory estimate is checked against: one real training step on this rank,
measured by the CPU allocator's own running total of live bytes. It shares no counting with the
trace: no fake tensor, no memory tracker.

c10's CPU allocator keeps that total across every thread once its
``FLAGS_caffe2_report_cpu_memory_usage`` is set (``count_every_thread``): a free that gloo makes on
one of its worker threads lowers it as a free on this thread does. ``torch.profiler`` records the
total at each allocation and free this thread makes (``total_allocated``), so the step's peak is
the highest total seen, less the total before the step; what existed before the step is added from
the tensors themselves. Set the flag before the model is built: a free of a tensor allocated
before it is not taken off the total.

A gloo worker thread can hold the last reference to a collective's buffer a little after the step
has dropped its own, when that thread is scheduled late; the buffer then outlives its last use and
one step in many reads a buffer high. The truth is the lowest peak of up to three identical steps
(two when the first two agree): the step as its code schedules it, which is what the trace
estimates. In a process group every rank runs the same number of steps, since a step's collectives
need all of them: a third runs on every rank when any rank's first two differ.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import OpTree
from torch.utils._pytree import tree_leaves

from meshbind.memory.step import training_step

_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def count_every_thread() -> None:
    """Turn on c10's process-wide count of CPU bytes (idempotent): from now on every allocation is
    sized on every thread, and every free of one of them, on any thread, lowers the total."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(library, _FLAG).value = True


STEPS = 3


def measured_step_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> int:
    """The most bytes live on the CPU at once during one ``training_step``: what existed before it
    (parameters, buffers, optimizer state, the inputs) and the most the step added to the allocator's
    total, frees on other threads included; the lowest of a few identical steps, ``lowest_step_added`` (the optimizer's
    state exists before the first, so each step starts and ends with the same tensors)."""
    return measured_peak(lambda: training_step(model, optimizer, args, kwargs), model, optimizer, (args, kwargs))


def measured_peak(step: Callable[[], None], model: nn.Module, optimizer: torch.optim.Optimizer | None, inputs: Any) -> int:
    """``measured_step_peak`` of any ``step`` of ``model`` (a pipeline rank's stages in a
    ``ModuleList``) that starts and ends with its parameters, buffers, optimizer state and ``inputs``."""
    count_every_thread()
    before = _storage_bytes(_existing_tensors(model, optimizer, inputs))
    added = lowest_step_added(step)
    after = _storage_bytes(_existing_tensors(model, optimizer, inputs))
    assert after == before, f"a step changed the tensors it starts with: {before} bytes before, {after} after"
    return before + added


def lowest_step_added(step: Callable[[], None]) -> int:
    """The fewest bytes any of up to ``STEPS`` runs of ``step`` added to the allocator's total at its
    peak; when the first two runs add the same, that is the answer (a late free raises one step in
    many, so two equal reads are the step as its code schedules it). Python's cyclic garbage is
    collected before each: a cycle of earlier objects collected during a step would lower its total
    by memory the step never held."""
    added = []
    for _ in range(STEPS):
        gc.collect()
        totals = _step_totals(step)
        added.append(max(totals) - totals[0])
        if len(added) == 2 and _every_rank_agrees(added[0] == added[1]):
            break
    return min(added)


def _every_rank_agrees(agrees: bool) -> bool:
    """``agrees`` on every rank of the default process group (this rank's alone outside one): a
    rank that ran a step the others skipped would wait on their collectives for ever."""
    if not dist.is_initialized():
        return agrees
    flag = torch.tensor([int(agrees)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _step_totals(step: Callable[[], None]) -> list[int]:
    """The allocator's total before ``step`` and after each allocation and free this thread made."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        step()
    assert profiled.profiler is not None and profiled.profiler.kineto_results is not None
    events = [
        node.typed[1]
        for node in OpTree(profiled.profiler.kineto_results).sorted_nodes
        if node.typed[0] == _EventType.Allocation and node.typed[1].device.type == "cpu"
    ]
    if not events:
        return [0]
    return [events[0].total_allocated - events[0].alloc_size, *(event.total_allocated for event in events)]


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
