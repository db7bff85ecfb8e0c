"""The meshes a plan binds to: ``MeshContext`` owns every group; ``MeshBinding`` hands out
one-dimensional meshes cut from them and never creates a group."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshbind.errors import BindingRefusedError
from meshbind.names import MeshSide
from meshbind.specs import LayoutContext
from meshbind.world import (
    AXES,
    DENSE_AXES,
    EXPERT_AXES,
    FSDP_AXES,
    FSDP_SHARD_AXES,
    FSDP_SHARD_MESH,
    PIPELINE_AXIS,
    World,
    canonical_axis,
)


def one_dimensional(mesh: object, what: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"{what} needs a one-dimensional DeviceMesh, got {mesh!r}")
    return mesh


def waited(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, completed."""
    return tensor.wait() if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor


def stage_mesh(
    device_type: str, world: World, shape: tuple[int, ...], names: tuple[str, ...]
) -> tuple[DeviceMesh, DeviceMesh | None]:
    """A mesh of ``shape`` (dims ``names``) over every rank of one pipeline stage: with ``pp``
    above 1 laid under ``pp``, outermost as torchtitan lays it, and cut to this rank's stage; and
    the one-dimensional ``pp`` mesh (``None`` without a pipeline)."""
    if world.pp == 1:
        return init_device_mesh(device_type, shape, mesh_dim_names=names), None
    whole = init_device_mesh(device_type, (world.pp, *shape), mesh_dim_names=(PIPELINE_AXIS, *names))
    return whole[names], whole[PIPELINE_AXIS]


@dataclass(frozen=True)
class MeshContext:
    """The device mesh (dims ``dp_replicate, dp_shard, cp, tp``) and, for expert parallelism, the
    expert mesh ``fsdp_moe_mesh`` over the same ranks with ``ep`` innermost (dims ``edp_replicate,
    edp_shard, ep``); under a pipeline, the one-dimensional ``pp_mesh`` across the stages, and
    both other meshes are this rank's stage's. The ``World`` they make (``world``) and the meshes
    FSDP shards over.

    Build one with ``MeshContext.build`` or wrap meshes you built: ``MeshContext(mesh, expert_mesh)``,
    whose dims are named from the world's axes (``dp`` read as ``dp_replicate``). Constructing one
    makes every group it will use: a ``dp_shard x cp`` device mesh gets its flattened
    ``dp_shard_cp`` dim (FSDP's shard axis) here, never later.
    """

    device_mesh: DeviceMesh
    fsdp_moe_mesh: DeviceMesh | None = None
    pp_mesh: DeviceMesh | None = None
    world: World = field(init=False, compare=False, repr=False)
    stage_group: dist.ProcessGroup | None = field(init=False, compare=False, repr=False)
    """Under a pipeline, a group of this rank's stage's ranks (what they alone must agree on);
    ``None`` otherwise."""
    _fsdp_meshes: dict[str, DeviceMesh] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.device_mesh, DeviceMesh) or not self.device_mesh.mesh_dim_names:
            raise ValueError("MeshContext.device_mesh must be a DeviceMesh with mesh_dim_names")
        sizes = {name: self.device_mesh.size(dim) for dim, name in enumerate(self.device_mesh.mesh_dim_names)}
        if self.fsdp_moe_mesh is not None:
            expert_names = self.fsdp_moe_mesh.mesh_dim_names or () if isinstance(self.fsdp_moe_mesh, DeviceMesh) else ()
            if "ep" not in expert_names:
                raise ValueError("MeshContext.fsdp_moe_mesh must be a DeviceMesh with an 'ep' dimension")
            if self.fsdp_moe_mesh.size() != self.device_mesh.size():
                raise ValueError(
                    f"the expert mesh spans {self.fsdp_moe_mesh.size()} ranks and the device mesh {self.device_mesh.size()}: "
                    "they must cover the same ranks"
                )
            sizes["ep"] = self.fsdp_moe_mesh.size(expert_names.index("ep"))
        if self.pp_mesh is not None:
            named_pp = isinstance(self.pp_mesh, DeviceMesh) and self.pp_mesh.mesh_dim_names == (PIPELINE_AXIS,)
            if not named_pp:
                raise ValueError("MeshContext.pp_mesh must be a one-dimensional DeviceMesh named 'pp'")
            sizes[PIPELINE_AXIS] = self.pp_mesh.size()
        try:
            world = World.of(sizes)
        except ValueError as error:
            raise ValueError(f"MeshContext: {error}") from None
        object.__setattr__(self, "world", world)
        object.__setattr__(self, "_fsdp_meshes", {})
        stage_group = None
        if self.pp_mesh is not None and dist.is_initialized() and dist.get_backend() != "fake":
            stage_ranks = self.device_mesh.mesh.flatten().tolist()
            stage_group = dist.new_group(stage_ranks, use_local_synchronization=True)
        object.__setattr__(self, "stage_group", stage_group)
        if self.dim_name("dp_shard") is not None:
            self.fsdp_mesh(MeshSide.DEVICE)  # FSDP's groups are made with the meshes, not when it is applied

    @classmethod
    def build(
        cls,
        *,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = 1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        dp: int | None = None,
        device_type: str | None = None,
    ) -> MeshContext:
        """Build both meshes over the initialised default process group.

        Every size is checked before any group is made (``World``'s rules): the product of
        ``pp, dp_replicate, dp_shard, cp, tp`` must be the world size and ``ep`` must divide
        ``dp_shard * cp * tp``. ``dp`` is another name for ``dp_replicate``. ``device_type``
        defaults to ``cuda`` under NCCL and ``cpu`` otherwise. With ``pp`` above 1 the meshes are
        laid with ``pp`` outermost (torchtitan's order) and each rank keeps its stage's.
        """
        if dp is not None:
            if dp_replicate != 1:
                raise ValueError("give dp or dp_replicate, not both: dp is another name for dp_replicate")
            dp_replicate = dp
        world = World(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("MeshContext.build needs an initialised process group (torch.distributed.init_process_group)")
        if world.size != dist.get_world_size():
            product = " * ".join(f"{axis}={getattr(world, axis)}" for axis in (PIPELINE_AXIS, *DENSE_AXES))
            raise ValueError(f"{product} = {world.size}, but the world size is {dist.get_world_size()}")
        device = device_type or ("cuda" if dist.get_backend() == "nccl" else "cpu")
        device_mesh, pp_mesh = stage_mesh(device, world, world.dense_shape, DENSE_AXES)
        expert_mesh = stage_mesh(device, world, world.expert_shape, EXPERT_AXES)[0] if ep > 1 else None
        return cls(device_mesh, expert_mesh, pp_mesh)

    def axis_sizes(self) -> dict[str, int]:
        """Every axis of the world and its size (``ep`` is 1 without an expert mesh)."""
        return self.world.axis_sizes()

    def same_meshes(self, other: MeshContext) -> bool:
        """Whether ``other`` wraps these very meshes. ``DeviceMesh`` equality compares layouts,
        not groups: a mesh rebuilt with the same layout is equal but communicates elsewhere."""
        return (
            self.device_mesh is other.device_mesh and self.fsdp_moe_mesh is other.fsdp_moe_mesh and self.pp_mesh is other.pp_mesh
        )

    def layout_context(self) -> LayoutContext:
        return LayoutContext(self.axis_sizes())

    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    def dim_name(self, axis: str) -> str | None:
        """The device mesh's own name for ``axis`` (a mesh wrapped with a ``dp`` dim keeps it)."""
        wanted = canonical_axis(axis)
        return next((name for name in self.device_mesh.mesh_dim_names or () if canonical_axis(name) == wanted), None)

    def fsdp_mesh(self, mesh: MeshSide) -> DeviceMesh:
        """The mesh FSDP shards a unit over: on the device side ``dp_shard x cp`` (flattened
        when both are above 1), on the expert side ``edp_shard``; with ``dp_replicate`` (or
        ``edp_replicate``) above 1, that replicate dim before it (HSDP). Made once, here."""
        if mesh not in self._fsdp_meshes:
            self._fsdp_meshes[mesh] = self._slice_fsdp_mesh(mesh)
        return self._fsdp_meshes[mesh]

    def _slice_fsdp_mesh(self, mesh: MeshSide) -> DeviceMesh:
        if mesh is MeshSide.EXPERT:
            if self.fsdp_moe_mesh is None:
                raise BindingRefusedError("mesh", "an FSDP unit holds expert parameters, but the mesh context has no expert mesh")
            names = self.fsdp_moe_mesh.mesh_dim_names or ()
            replicate_axis, shard_axis = FSDP_AXES[MeshSide.EXPERT]
            missing = [axis for axis in (replicate_axis, shard_axis) if axis not in names]
            if missing:
                raise BindingRefusedError("mesh", f"FSDP of expert parameters needs the expert mesh's {missing} dims")
            dims = (replicate_axis, shard_axis) if self.world.edp_replicate > 1 else (shard_axis,)
            return self.fsdp_moe_mesh[dims]
        present: dict[str, str | None] = {axis: self.dim_name(axis) for axis in FSDP_AXES[MeshSide.DEVICE]}
        shard = [name for axis in FSDP_SHARD_AXES if (name := present[axis]) is not None and self.world.size_of(axis) > 1]
        dp_shard = present["dp_shard"]
        if len(shard) > 1:
            self.device_mesh[tuple(shard)]._flatten(FSDP_SHARD_MESH)
            shard_dim = FSDP_SHARD_MESH
        elif shard:
            shard_dim = shard[0]
        elif dp_shard is not None:
            shard_dim = dp_shard
        else:
            raise BindingRefusedError("mesh", "FSDP needs a dp_shard dim on the device mesh (it may be of size 1)")
        replicate = present["dp_replicate"]
        if replicate is not None and self.world.dp_replicate > 1:
            return self.device_mesh[(replicate, shard_dim)]
        return self.device_mesh[shard_dim]


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
        if axis in EXPERT_AXES and context.fsdp_moe_mesh is not None and axis in (context.fsdp_moe_mesh.mesh_dim_names or ()):
            return context.fsdp_moe_mesh[axis]
        name = context.dim_name(axis)
        if name is None:
            available = list(context.device_mesh.mesh_dim_names or ()) + (["ep"] if context.fsdp_moe_mesh is not None else [])
            raise BindingRefusedError("mesh", f"the mesh context has no {axis!r} axis (axes: {', '.join(available)})")
        return context.device_mesh[name]


def check_resolved_for(plan_context: LayoutContext, mesh_context: MeshContext) -> None:
    """A plan was checked against its context's world: the meshes must make the same one."""
    planned, actual = plan_context.world, mesh_context.world
    if planned != actual:
        differing = [axis for axis in AXES if getattr(planned, axis) != getattr(actual, axis)]
        was = ", ".join(f"{axis}={getattr(planned, axis)}" for axis in differing)
        now = ", ".join(f"{axis}={getattr(actual, axis)}" for axis in differing)
        message = f"the plan was resolved for {was}, but the meshes have {now}: resolve it for these meshes"
        raise BindingRefusedError("mesh", message)
