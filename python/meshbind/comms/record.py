"""Every collective one traced step issues, as it reaches torch's dispatcher: FSDP2's
``c10d`` calls on the process group and the functional collectives of DTensor, CP and EP
(``_c10d_functional``). Each is counted by kind, the mesh axes of its group, its dtype and its
size as nccl-tests sizes a collective: the gathered output of an all-gather, the input of a
reduce-scatter, the buffer of an all-reduce, all-to-all or broadcast, the tensor of a send or
receive."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.distributed_c10d import _resolve_process_group  # type: ignore[attr-defined]
from torch.utils._python_dispatch import TorchDispatchMode

from meshbind.comms.timeline import Event, Timeline, Transfer
from meshbind.mesh import MeshContext
from meshbind.world import DENSE_AXES, PIPELINE_AXIS, World


@dataclass(frozen=True)
class Collective:
    """The calls of one kind of collective over one group and dtype in a step, and their bytes."""

    kind: str
    """``all-gather``, ``reduce-scatter``, ``all-reduce``, ``all-to-all``, ``broadcast``, ``send``, ``receive``."""
    axes: tuple[str, ...]
    """The mesh axes the group spans (``("dp_shard", "cp")`` for FSDP's group over both)."""
    group_size: int
    dtype: str
    count: int
    bytes: int

    @property
    def key(self) -> tuple[str, tuple[str, ...], int, str]:
        """What tells collectives apart: kind, axes, group size, dtype."""
        return (self.kind, self.axes, self.group_size, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "axes": list(self.axes),
            "group_size": self.group_size,
            "dtype": self.dtype,
            "count": self.count,
            "bytes": self.bytes,
        }


def _size(tensors: Any) -> tuple[torch.dtype, int]:
    """The dtype and bytes of a tensor, or of a list (or list of lists) of them."""
    flat = [tensors] if isinstance(tensors, torch.Tensor) else _flatten(tensors)
    return flat[0].dtype, sum(t.numel() * t.element_size() for t in flat)


def _flatten(items: Sequence[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for item in items:
        found.extend([item] if isinstance(item, torch.Tensor) else _flatten(item))
    return found


def _gathered(args: Sequence[Any]) -> tuple[torch.dtype, int]:
    """A functional all-gather's output: its input times the group's size."""
    dtype, size = _size(args[0])
    return dtype, size * int(args[1])


# Each op: its kind, the argument holding its group, and the dtype and bytes it moves.
_OPS: dict[str, tuple[str, int, Callable[[Sequence[Any]], tuple[torch.dtype, int]]]] = {
    "c10d._allgather_base_": ("all-gather", 2, lambda a: _size(a[0])),
    "c10d.allgather_": ("all-gather", 2, lambda a: _size(a[0])),
    "c10d.allgather_into_tensor_coalesced_": ("all-gather", 2, lambda a: _size(a[0])),
    "c10d._reduce_scatter_base_": ("reduce-scatter", 2, lambda a: _size(a[1])),
    "c10d.reduce_scatter_": ("reduce-scatter", 2, lambda a: _size(a[1])),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce-scatter", 2, lambda a: _size(a[1])),
    "c10d.allreduce_": ("all-reduce", 1, lambda a: _size(a[0])),
    "c10d.allreduce_coalesced_": ("all-reduce", 1, lambda a: _size(a[0])),
    "c10d.alltoall_base_": ("all-to-all", 2, lambda a: _size(a[1])),
    "c10d.alltoall_": ("all-to-all", 2, lambda a: _size(a[1])),
    "c10d.broadcast_": ("broadcast", 1, lambda a: _size(a[0])),
    "c10d.send": ("send", 1, lambda a: _size(a[0])),
    "c10d.recv_": ("receive", 1, lambda a: _size(a[0])),
    "_c10d_functional.all_gather_into_tensor": ("all-gather", 2, _gathered),
    "_c10d_functional.all_gather_into_tensor_out": ("all-gather", 2, _gathered),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all-gather", 2, _gathered),
    "_c10d_functional.reduce_scatter_tensor": ("reduce-scatter", 3, lambda a: _size(a[0])),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce-scatter", 3, lambda a: _size(a[0])),
    "_c10d_functional.all_reduce": ("all-reduce", 2, lambda a: _size(a[0])),
    "_c10d_functional.all_reduce_": ("all-reduce", 2, lambda a: _size(a[0])),
    "_c10d_functional.all_reduce_coalesced": ("all-reduce", 2, lambda a: _size(a[0])),
    "_c10d_functional.all_to_all_single": ("all-to-all", 3, lambda a: _size(a[0])),
    "_c10d_functional_autograd.all_to_all_single": ("all-to-all", 3, lambda a: _size(a[0])),
    "_c10d_functional.broadcast": ("broadcast", 2, lambda a: _size(a[0])),
    "_c10d_functional.broadcast_": ("broadcast", 2, lambda a: _size(a[0])),
}


class CollectiveRecord(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts every collective dispatched while it is entered, each under the axes of its group
    (``GroupAxes``)."""

    def __init__(self, timeline: Timeline) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._group_axes: GroupAxes | None = None
        self.timeline = timeline
        """Where every operator and collective is added, in order."""

    @contextmanager
    def naming(self, group_axes: GroupAxes) -> Iterator[None]:
        """Counting while entered, each collective under its group's axes in ``group_axes``."""
        self._group_axes = group_axes
        try:
            with self:
                yield
        finally:
            self._group_axes = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", "")
        known = _OPS.get(f"{namespace}.{getattr(func, '_opname', '')}")
        if known is None:
            out = func(*args, **kwargs)
            if namespace not in _NO_COMPUTE:
                self.timeline.compute(func, args, kwargs, out)
            return out
        kind, group_at, moved = known
        dtype, size = moved(args)
        assert self._group_axes is not None
        group = self._group_axes.of(args[group_at])
        dtype_name = str(dtype).removeprefix("torch.")
        # FSDP2 calls the process group itself, from streams of its own; the rest waits on the result.
        beside = namespace == "c10d" and kind in ("all-gather", "reduce-scatter", "all-reduce")
        transfer = Transfer(kind, group.axes, group.size, size, group.lowest, group.highest, beside, dtype_name)
        self.timeline.transfer(transfer, _flatten(args[:1]))
        return func(*args, **kwargs)

    def collectives(self) -> list[Collective]:
        """What was counted, in the order each kind of call was first made."""
        return collectives_in(self.timeline.events)


def collectives_in(events: Sequence[Event]) -> list[Collective]:
    """The collectives of a timeline's ``events``, counted as ``CollectiveRecord`` counts them."""
    calls: dict[tuple[str, tuple[str, ...], int, str], list[int]] = {}
    for event in events:
        if isinstance(event, Transfer):
            counted = calls.setdefault((event.kind, event.axes, event.group_size, event.dtype), [0, 0])
            counted[0] += 1
            counted[1] += event.bytes
    return [Collective(*key, count, size) for key, (count, size) in calls.items()]


# Waiting on a collective, and c10d's bookkeeping: no kernel of the step's own.
_NO_COMPUTE = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


@dataclass(frozen=True)
class Group:
    """A process group as a step time needs it: the mesh axes it spans, its size, and its lowest
    and highest rank (whether it stays within a node)."""

    axes: tuple[str, ...]
    size: int
    lowest: int
    highest: int


class GroupAxes:
    """The mesh axes of each process group of one rank's meshes: a group a mesh dim owns is named
    by the dim; one made by flattening dims (FSDP's group over ``dp_shard`` and ``cp``) by the
    axes of the device mesh its ranks differ on."""

    def __init__(self, mesh_context: MeshContext, world: World) -> None:
        self._world = world
        self._dims: dict[str, str] = {}
        self._known: dict[str, Group] = {}
        meshes = [mesh_context.device_mesh, mesh_context.fsdp_moe_mesh, mesh_context.pp_mesh]
        for mesh in (mesh for mesh in meshes if mesh is not None):
            for dim, name in enumerate(mesh.mesh_dim_names or ()):
                self._dims[mesh.get_group(dim).group_name] = name

    def of(self, group: Any) -> Group:
        """The axes, size and span of ``group``: a process group, its name, or torch's boxed handle."""
        if isinstance(group, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        name = group if isinstance(group, str) else group.group_name
        if name not in self._known:
            with unset_fake_temporarily():  # the step runs under fake tensors: these ranks are real
                ranks = torch.tensor(dist.get_process_group_ranks(_resolve_process_group(name)))  # type: ignore[arg-type]
                axes = (self._dims[name],) if name in self._dims else self._differing_axes(ranks)
                self._known[name] = Group(axes, len(ranks), int(ranks.min()), int(ranks.max()))
        return self._known[name]

    def _differing_axes(self, ranks: torch.Tensor) -> tuple[str, ...]:
        """The axes on which ``ranks`` do not all have one coordinate (``World.coordinates``'
        order: ``pp`` outermost, the last device-mesh axis varying fastest), in tensor arithmetic:
        a group may span most of a world."""
        world = self._world
        differing = []
        stage = ranks // world.stage_size
        if stage.min() != stage.max():
            differing.append(PIPELINE_AXIS)
        stride = world.stage_size
        for axis in DENSE_AXES:
            stride //= getattr(world, axis)
            coordinate = (ranks // stride) % getattr(world, axis)
            if coordinate.min() != coordinate.max():
                differing.append(axis)
        return tuple(differing)
