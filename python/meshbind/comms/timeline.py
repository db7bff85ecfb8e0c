"""What one traced step does, in the order it does it: each operator's arithmetic and the bytes it
reads and writes, each collective with its group's span of ranks, and the marks a step time needs
(where the optimizer starts; which pipeline action runs). It names no GPU: a step time prices it
for one (``steptime/``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torch.utils.flop_counter import flop_registry

_HALF = (torch.bfloat16, torch.float16)
# Operators that make a tensor without touching memory (the allocator's work, not a kernel's).
_NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "alias"})


@dataclass(frozen=True, slots=True)
class Compute:
    """One operator: its FLOPs (torch's own flop counter formulas; zero for those it has none,
    which are bound by memory), the bytes of its tensors read and written, and whether it runs in
    half precision (bf16/fp16: the tensor cores' peak)."""

    flops: int
    bytes: int
    half: bool
    waits_for: int = -1
    """The ``gather`` number of the all-gather beside the computation whose output it is the first
    to read (FSDP's copy-out of a unit's gathered parameters), or -1. A number, not a place, so a
    stretch cut from the timeline, or put together from others' stretches, keeps it."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One collective call: its kind, group axes and size, bytes as nccl-tests sizes it, the lowest
    and highest rank of its group, and whether it runs beside the computation (FSDP's, on its own
    streams) rather than holding it up until it ends."""

    kind: str
    axes: tuple[str, ...]
    group_size: int
    bytes: int
    lowest_rank: int
    highest_rank: int
    beside_compute: bool
    dtype: str = ""
    gather: int = -1
    """An all-gather beside the computation: its number in the timeline, which the operator that
    first reads its output names (``Compute.waits_for``); -1 for any other collective."""


@dataclass(frozen=True, slots=True)
class Mark:
    """A point of the step: ``optimizer`` (it waits for every gradient), or a pipeline action
    starting (``F``, ``B``, ``I``, ``W`` of ``stage`` and ``microbatch``), or the schedule's end."""

    what: str
    stage: int = -1
    microbatch: int = -1


Event = Compute | Transfer | Mark

OPTIMIZER = "optimizer"
SCHEDULE_END = "end of schedule"


@dataclass(frozen=True)
class CutTimeline:
    """A timeline cut at its marks of some kinds (``Timeline.cut``)."""

    before: tuple[Event, ...]
    """Before the first such mark."""
    parts: tuple[tuple[Event, ...], ...]
    """Each such mark and what follows it, to the next one or the schedule's end."""
    after: tuple[Event, ...]
    """From the schedule's end: the optimizer step."""


@dataclass
class Timeline:
    """The events of one traced step, in order."""

    events: list[Event] = field(default_factory=list)
    _unread: dict[int, int] = field(default_factory=dict)
    """Tensors (by id) an all-gather beside the computation wrote and nothing has read yet, or
    views of them: the all-gather's number."""
    _gathers: int = 0

    def transfer(self, transfer: Transfer, outputs: Sequence[torch.Tensor]) -> None:
        """Adds a collective; an all-gather beside the computation writes ``outputs``."""
        if transfer.beside_compute and transfer.kind == "all-gather":
            self._gathers += 1
            transfer = replace(transfer, gather=self._gathers)
            self._unread.update(dict.fromkeys(map(id, outputs), self._gathers))
        self.events.append(transfer)

    def compute(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        """Adds ``func``'s cost, called on ``args``/``kwargs`` and returning ``out``; a view or an
        operator that only allocates costs nothing."""
        if func._opname in _NO_KERNEL or func.namespace == "prim":  # prim: a tensor's metadata (its device), no kernel
            return
        inputs = _tensors((args, kwargs), [])
        outputs = _tensors(out, [])
        gathered = [self._unread[id(t)] for t in inputs if id(t) in self._unread]
        if func.is_view:
            if gathered:
                self._unread.update(dict.fromkeys(map(id, outputs), max(gathered)))
            return
        if gathered:
            self._unread = {key: index for key, index in self._unread.items() if index > max(gathered)}
        if not inputs and not outputs:
            return
        counted = flop_registry.get(func._overloadpacket)
        flops = 0
        if counted is not None:
            args, kwargs, out = tree_map_only(DTensor, _local, (args, kwargs, out))
            flops = int(counted(*args, **kwargs, out_val=out))
        read = {id(t): t for t in inputs}
        moved = sum(map(_bytes, read.values())) + sum(_bytes(t) for t in outputs if id(t) not in read)
        dtype = (outputs or inputs)[0].dtype
        self.events.append(Compute(flops, moved, dtype in _HALF, max(gathered, default=-1)))

    def mark(self, what: str, stage: int = -1, microbatch: int = -1) -> None:
        self.events.append(Mark(what, stage, microbatch))

    def cut(self, kinds: tuple[str, ...]) -> CutTimeline:
        """The events cut at each mark of ``kinds``, up to the schedule's end."""
        before: list[Event] = []
        parts: list[list[Event]] = []
        after: list[Event] = []
        current = before
        for event in self.events:
            if isinstance(event, Mark) and event.what in kinds:
                parts.append([])
                current = parts[-1]
            elif isinstance(event, Mark) and event.what == SCHEDULE_END:
                current = after
            current.append(event)
        return CutTimeline(tuple(before), tuple(map(tuple, parts)), tuple(after))


@dataclass(frozen=True)
class TracedWork:
    """What a class of ranks does in one step: its whole step's timeline, or, where the model's
    alike blocks were traced at a few depths, one timeline per depth and the depth to extrapolate to."""

    timelines: tuple[Timeline, ...]
    full_depth: int | None = None
    """The alike blocks' count, when ``timelines`` hold the traced depths."""


def _bytes(tensor: torch.Tensor) -> int:
    """What a kernel reads or writes of ``tensor``: its elements, or its storage where that is
    smaller (an expanded tensor repeats its elements without holding them)."""
    whole = tensor.numel() * tensor.element_size()
    return min(whole, tensor.untyped_storage().nbytes()) if whole else 0


def _tensors(value: Any, into: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in ``value`` (an operator's arguments or result: tensors, nested in lists, tuples
    and dicts) added to ``into``; a DTensor as its shard, as its kernel runs on the shard (an
    operator on DTensors reaches the trace whole, as the optimizer's do)."""
    if isinstance(value, DTensor):
        into.append(value._local_tensor)
    elif isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, into)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, into)
    return into


def _local(tensor: DTensor) -> torch.Tensor:
    local: torch.Tensor = tensor._local_tensor
    return local
