"""Every collective of one real step on a gloo world, from records that share no code with the
trace: torch's profiler (each call's ``c10d`` op and its tensors' shapes, in call order) and
c10d's flight recorder (the process group each call ran on, and its dtypes, in the same order).
The flight recorder keeps no send or receive on gloo: each of those is read from the
``torch.distributed.P2POp`` made for it (its tensor and group), their number checked against the
profiler's."""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d_internals

FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "100000"}
"""The environment a world needs for ``recorded_collectives``."""

# Each c10d op the process group runs: the collective it is, and which argument holds the tensor(s)
# whose size nccl-tests gives (an all-gather's output, a reduce-scatter's input, ...).
_KINDS = {
    "c10d::_allgather_base_": ("all-gather", 0),
    "c10d::allgather_": ("all-gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all-gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce-scatter", 1),
    "c10d::reduce_scatter_": ("reduce-scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce-scatter", 1),
    "c10d::allreduce_": ("all-reduce", 0),
    "c10d::alltoall_base_": ("all-to-all", 1),
    "c10d::broadcast_": ("broadcast", 0),
}
_POINT_TO_POINT = ("c10d::send", "c10d::recv_")
_DTYPES = {
    "Float": torch.float32,
    "Double": torch.float64,
    "BFloat16": torch.bfloat16,
    "Half": torch.float16,
    "Long": torch.int64,
    "Int": torch.int32,
}
_AXES = ("dp_replicate", "dp_shard", "cp", "tp", "edp_replicate", "edp_shard", "ep", "pp")

Key = tuple[str, tuple[str, ...], int, str]


def recorded_collectives(step: Callable[[], None], sizes: dict[str, int]) -> dict[Key, list[int]]:
    """Each (kind, axes, group size, dtype) of the collectives ``step`` runs on this rank, with its
    calls and bytes; ``sizes`` gives each mesh axis's size (a group's size is its axes')."""
    before = len(_flight_entries())
    made: list[dist.P2POp] = []
    make = dist.P2POp.__init__

    def recording(op: dist.P2POp, *args: Any, **kwargs: Any) -> None:
        make(op, *args, **kwargs)
        made.append(op)

    dist.P2POp.__init__ = recording  # type: ignore[method-assign]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
            step()
    finally:
        dist.P2POp.__init__ = make  # type: ignore[method-assign]
    entries = _flight_entries()[before:]
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        profile.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    calls = sorted((e for e in events if e.get("name") in _KINDS), key=lambda e: (e["ts"], -e.get("dur", 0)))
    assert len(calls) == len(entries), f"the profiler saw {len(calls)} collectives, the flight recorder {len(entries)}"
    sent = sum(e.get("name") in _POINT_TO_POINT for e in events)
    assert sent == len(made), f"the profiler saw {sent} sends and receives, {len(made)} were made"
    found: dict[Key, list[int]] = {}

    def add(kind: str, axes: tuple[str, ...], dtype: torch.dtype, size: int) -> None:
        key = (kind, axes, math.prod(sizes[axis] for axis in axes), str(dtype).removeprefix("torch."))
        totals = found.setdefault(key, [0, 0])
        totals[0] += 1
        totals[1] += size

    for call, entry in zip(calls, entries, strict=True):
        kind, sized = _KINDS[call["name"]]
        dtype = _DTYPES[entry["input_dtypes"][0]]
        elements = sum(math.prod(dims) for dims in _shapes(call["args"]["Input Dims"][sized]))
        add(kind, _axes_of(entry["process_group"][1], sizes), dtype, elements * dtype.itemsize)
    for op in made:
        assert op.group is not None
        kind = "send" if op.op is dist.isend else "receive"
        add(kind, _axes_of(op.group.group_desc, sizes), op.tensor.dtype, op.tensor.numel() * op.tensor.element_size())
    return found


def _flight_entries() -> list[dict[str, Any]]:
    return list(json.loads(c10d_internals._dump_fr_trace_json()).get("entries", []))


def _shapes(dims: Any) -> list[list[int]]:
    """A tensor's dims, or each tensor's of a list of them."""
    return [dims] if not dims or isinstance(dims[0], int) else [shape for inner in dims for shape in _shapes(inner)]


def _axes_of(description: str, sizes: dict[str, int]) -> tuple[str, ...]:
    """The axes a group of ``init_device_mesh`` spans, from its description (``mesh_dp_shard_cp``);
    torch runs a mesh dim over the whole world on the default group: every device-mesh axis then."""
    if description == "default_pg":
        return tuple(axis for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if sizes[axis] > 1)
    rest = description.removeprefix("mesh_")
    axes = []
    while rest:
        axis = max((a for a in _AXES if rest == a or rest.startswith(f"{a}_")), key=len, default=None)
        assert axis is not None, description
        axes.append(axis)
        rest = rest[len(axis) :].removeprefix("_")
    return tuple(axes)
