"""The meshes a plan binds to (SPEC §6): ``MeshContext`` owns every group; ``MeshBinding`` hands out
one-dimensional meshes cut from them and never creates a group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshbind.errors import BindingRefusedError
from meshbind.specs import LayoutContext

DEVICE_MESH_DIMS = ("dp", "cp", "tp")
EXPERT_MESH_DIMS = ("edp_replicate", "edp_shard", "ep")


def one_dimensional(mesh: object, what: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"{what} needs a one-dimensional DeviceMesh, got {mesh!r}")
    return mesh


def waited(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, completed."""
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def process_group_count() -> int:
    """How many process groups exist now (the default one included): what "creates no group" counts."""
    return len(dist.distributed_c10d._world.pg_map)


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class MeshContext:
    """The device mesh (dims ``dp, cp, tp``) and, for expert parallelism, the expert mesh
    ``fsdp_moe_mesh`` over the same ranks with ``ep`` innermost (dims ``edp_replicate, edp_shard, ep``).

    Build one with ``MeshContext.build`` or wrap meshes you built: ``MeshContext(mesh, expert_mesh)``.
    """

    device_mesh: DeviceMesh
    fsdp_moe_mesh: DeviceMesh | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device_mesh, DeviceMesh) or not self.device_mesh.mesh_dim_names:
            raise ValueError("MeshContext.device_mesh must be a DeviceMesh with mesh_dim_names")
        if self.fsdp_moe_mesh is not None:
            if not isinstance(self.fsdp_moe_mesh, DeviceMesh) or "ep" not in (self.fsdp_moe_mesh.mesh_dim_names or ()):
                raise ValueError("MeshContext.fsdp_moe_mesh must be a DeviceMesh with an 'ep' dimension")
            if self.fsdp_moe_mesh.size() != self.device_mesh.size():
                raise ValueError(
                    f"the expert mesh spans {self.fsdp_moe_mesh.size()} ranks and the device mesh {self.device_mesh.size()}: "
                    "they must cover the same ranks"
                )

    @classmethod
    def build(
        cls, *, dp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, edp_shard: int | None = None, device_type: str | None = None
    ) -> MeshContext:
        """Build both meshes over the initialised default process group.

        Every size is checked before any group is made: ``dp * cp * tp`` must be the world size,
        ``ep`` must divide it, and ``edp_shard`` (default: world / ep) must divide world / ep.
        ``device_type`` defaults to ``cuda`` under NCCL and ``cpu`` otherwise.
        """
        sizes = {name: _positive(name, value) for name, value in {"dp": dp, "cp": cp, "tp": tp, "ep": ep}.items()}
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("MeshContext.build needs an initialised process group (torch.distributed.init_process_group)")
        world = dist.get_world_size()
        if dp * cp * tp != world:
            raise ValueError(f"dp * cp * tp = {dp} * {cp} * {tp} = {dp * cp * tp}, but the world size is {world}")
        if world % ep:
            raise ValueError(f"ep = {ep} does not divide the world size {world}")
        shard = world // ep if edp_shard is None else _positive("edp_shard", edp_shard)
        if (world // ep) % shard:
            raise ValueError(f"edp_shard = {shard} does not divide world / ep = {world // ep}")
        device = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        device_mesh = init_device_mesh(device, (sizes["dp"], sizes["cp"], sizes["tp"]), mesh_dim_names=DEVICE_MESH_DIMS)
        expert_mesh = None
        if ep > 1:
            expert_mesh = init_device_mesh(device, (world // (ep * shard), shard, ep), mesh_dim_names=EXPERT_MESH_DIMS)
        return cls(device_mesh, expert_mesh)

    def axis_sizes(self) -> dict[str, int]:
        """Every axis and its size: the device mesh's dims and ``ep`` (1 without an expert mesh)."""
        names = self.device_mesh.mesh_dim_names or ()
        sizes = {name: self.device_mesh.size(dim) for dim, name in enumerate(names)}
        if self.fsdp_moe_mesh is not None:
            expert_names = self.fsdp_moe_mesh.mesh_dim_names or ()
            sizes["ep"] = self.fsdp_moe_mesh.size(expert_names.index("ep"))
        sizes.setdefault("ep", 1)
        return sizes

    def same_meshes(self, other: MeshContext) -> bool:
        """Whether ``other`` wraps these very meshes. ``DeviceMesh`` equality compares layouts,
        not groups: a mesh rebuilt with the same layout is equal but communicates elsewhere."""
        return self.device_mesh is other.device_mesh and self.fsdp_moe_mesh is other.fsdp_moe_mesh

    def layout_context(self) -> LayoutContext:
        return LayoutContext(self.axis_sizes())

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type


class MeshBinding:
    """One-dimensional meshes by axis name, cut from a ``MeshContext``'s prebuilt meshes."""

    def __init__(self, mesh_context: MeshContext) -> None:
        if not isinstance(mesh_context, MeshContext):
            raise TypeError(f"MeshBinding needs a MeshContext, got {type(mesh_context).__name__}")
        self.mesh_context = mesh_context

    def axis_mesh(self, axis: str) -> DeviceMesh:
        """``ep`` from the expert mesh when there is one, otherwise the device mesh's dimension
        of that name. Slicing a dimension reuses the group made with the mesh: none is created."""
        context = self.mesh_context
        if axis == "ep" and context.fsdp_moe_mesh is not None:
            return context.fsdp_moe_mesh["ep"]
        names = context.device_mesh.mesh_dim_names or ()
        if axis not in names:
            available = list(names) + (["ep"] if context.fsdp_moe_mesh is not None else [])
            raise BindingRefusedError("mesh", f"the mesh context has no {axis!r} axis (axes: {', '.join(available)})")
        return context.device_mesh[axis]


def check_resolved_for(plan_context: LayoutContext, mesh_context: MeshContext) -> None:
    """A plan was checked against its context's axis sizes: every axis it names must be the
    meshes' own, at that size (axes it does not name place nothing in a valid plan)."""
    sizes = mesh_context.axis_sizes()
    differing = {axis: size for axis, size in plan_context.axis_sizes.items() if sizes.get(axis) != size}
    if differing:
        planned = ", ".join(f"{axis}={size}" for axis, size in differing.items())
        actual = ", ".join(f"{axis}={sizes[axis]}" if axis in sizes else f"no {axis}" for axis in differing)
        message = f"the plan was resolved for {planned}, but the meshes have {actual}: resolve it for these meshes"
        raise BindingRefusedError("mesh", message)
