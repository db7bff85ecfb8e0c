"""Applying layouts: the plan's placements become torch ``DTensor`` parameters on the
prebuilt meshes, between resolution and binding ("bind after layout").

``apply_layouts`` first finds every planned parameter, every attribute that holds it (ties), its
mesh (the prebuilt mesh sliced to the named axes) and its placements, and checks them all; only
then does it distribute anything, and only once every new parameter exists does it swap them in,
so a failure leaves every parameter as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from meshbind.agreement import check_ranks_agree, plan_agreement
from meshbind.errors import BindingRefusedError, LayoutError
from meshbind.family import family_spec, record_family_distribution
from meshbind.mesh import MeshContext, check_resolved_for
from meshbind.model_index import ModelIndex
from meshbind.modules import submodule, unwrapped
from meshbind.placements import placements_text, split_dim
from meshbind.resolution.plan import ParallelPlan
from meshbind.specs import ParallelModuleSpec


@dataclass
class _Planned:
    """One planned parameter: where it is, every attribute holding it, and where it goes."""

    fqn: str
    parameter: nn.Parameter
    named: Mapping[str, Placement]
    mesh: DeviceMesh
    """The prebuilt mesh sliced to the named axes, in its own dim order."""
    placements: tuple[Placement, ...]
    whole_mesh: DeviceMesh
    """The prebuilt mesh it is sliced from, on which the values are scattered from rank 0."""
    whole_placements: tuple[Placement, ...]
    holders: list[tuple[nn.Module, str]] = field(default_factory=list)


def apply_layouts(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> list[str]:
    """Make every ``params`` entry of every planned module an ``nn.Parameter`` holding a
    ``DTensor`` with the plan's placements; returns the FQNs of the parameters distributed by
    this call (one already distributed with the same layout is left alone). Raises
    ``LayoutError`` listing every problem before any parameter changes."""
    check_application(model, plan, mesh_context)
    check_ranks_agree(
        "apply_layouts", lambda: plan_agreement(model, plan, mesh_context), model=model, group=mesh_context.stage_group
    )
    planned = _planned_parameters(model, plan, mesh_context)
    pending = [entry for entry in planned if not _already_there(entry)]
    # Every new parameter exists before any attribute changes.
    replacements = [nn.Parameter(_distributed(entry), entry.parameter.requires_grad) for entry in pending]
    for entry, replacement in zip(pending, replacements, strict=True):
        for module, name in entry.holders:
            module._parameters[name] = replacement
    _record_families(model, plan, mesh_context)
    return [entry.fqn for entry in pending]


def check_application(model: object, plan: object, mesh_context: object) -> None:
    """The arguments of a step applying ``plan`` (layouts, FSDP) are what it takes, and the plan was
    resolved for these meshes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a ParallelPlan, got {type(plan).__name__}")
    if not isinstance(mesh_context, MeshContext):
        raise TypeError(f"mesh_context must be a MeshContext, got {type(mesh_context).__name__}")
    check_resolved_for(plan.context, mesh_context)


def _planned_parameters(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> list[_Planned]:
    """Every planned parameter once (ties keyed by their first planned FQN), checked; raises one
    ``LayoutError`` naming every problem."""
    problems: list[str] = []
    by_identity: dict[int, _Planned] = {}
    slices: dict[tuple[str, ...], DeviceMesh] = {}  # slicing a mesh builds a new object each time
    for module_fqn, sharding in plan.sharding.items():
        if not sharding.params:
            continue
        try:
            module = submodule(model, module_fqn)
        except ValueError as error:
            problems.append(str(error))
            continue
        for path, named in sharding.params.items():
            fqn = f"{module_fqn}.{path}" if module_fqn else path
            parameter = _parameter(module, path)
            if parameter is None:
                problems.append(f"{fqn!r}: the plan places a parameter this model does not have")
                continue
            seen = by_identity.get(id(parameter))
            if seen is not None:
                if dict(seen.named) != dict(named):
                    problems.append(
                        f"{fqn!r} is the parameter {seen.fqn!r} (tied), given two layouts: "
                        f"{placements_text(seen.named)} and {placements_text(named)}"
                    )
                continue
            mesh_and_placements = _mesh_and_placements(fqn, named, mesh_context, slices, problems)
            if mesh_and_placements is not None:
                by_identity[id(parameter)] = _Planned(fqn, parameter, named, *mesh_and_placements)
    for entry in by_identity.values():
        if isinstance(entry.parameter, DTensor) and not _already_there(entry):
            problems.append(
                f"{entry.fqn!r} is already distributed as {entry.parameter.placements} on {entry.parameter.device_mesh}, "
                f"not as {placements_text(entry.named)}: redistribute it or resolve the plan it was applied with"
            )
    if problems:
        raise LayoutError(problems)
    _find_holders(model, plan.index, by_identity)
    return list(by_identity.values())


def _find_holders(model: nn.Module, known: ModelIndex | None, by_identity: dict[int, _Planned]) -> None:
    """Every attribute holding a planned parameter, so ties survive as one parameter: each FQN of
    it the plan's index of this model knows, when each holds it still; else every module's
    ``_parameters``, walked (another model, or one wrapped since it was resolved)."""
    found = _indexed_holders(model, known, by_identity.values()) if known is not None and known.is_of(model) else None
    if found is not None:
        for entry, holders in zip(by_identity.values(), found, strict=True):
            entry.holders += holders
        return
    for module in unwrapped(model).modules():
        for name, parameter in module._parameters.items():
            holder = by_identity.get(id(parameter)) if parameter is not None else None
            if holder is not None:
                holder.holders.append((module, name))


def _indexed_holders(
    model: nn.Module, index: ModelIndex, entries: Iterable[_Planned]
) -> list[list[tuple[nn.Module, str]]] | None:
    """The holders of each entry's parameter by the index's FQNs of it, ``None`` when one of them
    no longer holds it."""
    later: dict[str, list[str]] = {}
    for alias, first in index.ties.items():
        later.setdefault(first, []).append(alias)
    found = []
    for entry in entries:
        first = index.ties.get(entry.fqn, entry.fqn)
        holders = []
        for fqn in (first, *later.get(first, ())):
            module_fqn, _, name = fqn.rpartition(".")
            try:
                module = submodule(model, module_fqn)
            except BindingRefusedError:
                return None
            if module._parameters.get(name) is not entry.parameter:
                return None
            holders.append((module, name))
        found.append(holders)
    return found


def _distributed(entry: _Planned) -> DTensor:
    """The parameter as a DTensor on its sliced mesh, its values from global rank 0: scattered over
    the whole prebuilt mesh (``Replicate`` on the axes the mapping does not name), whose first
    rank is rank 0, then viewed on the slice (a sliced mesh's own first rank differs per slice).
    A meta tensor has no values to send: its even shard is made on the slice directly."""
    tensor = entry.parameter.detach()
    if tensor.is_meta:
        local_shape = _even_local_shape(tensor.shape, entry.mesh, entry.placements)
        if local_shape is not None:
            local = torch.empty(local_shape, dtype=tensor.dtype, device="meta")
            return DTensor.from_local(
                local, entry.mesh, entry.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
            )
    if tensor.is_meta or entry.whole_mesh is entry.mesh:
        return distribute_tensor(tensor, entry.mesh, entry.placements)
    whole = distribute_tensor(tensor, entry.whole_mesh, entry.whole_placements)
    local = whole.to_local()
    return DTensor.from_local(local, entry.mesh, entry.placements, run_check=False, shape=whole.shape, stride=whole.stride())


def _even_local_shape(shape: torch.Size, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> list[int] | None:
    """Each rank's shard shape when every ``Shard`` divides its dimension (``None``: torch's uneven
    chunks, left to ``distribute_tensor``)."""
    local = list(shape)
    for placement, size in zip(placements, mesh.shape, strict=True):
        dim = split_dim(placement, len(local)) if isinstance(placement, Shard) else None
        if dim is not None:
            if local[dim] % size:
                return None
            local[dim] //= size
    return local


def _mesh_and_placements(
    fqn: str,
    named: Mapping[str, Placement],
    mesh_context: MeshContext,
    slices: dict[tuple[str, ...], DeviceMesh],
    problems: list[str],
) -> tuple[DeviceMesh, tuple[Placement, ...], DeviceMesh, tuple[Placement, ...]] | None:
    """The prebuilt mesh sliced to the named axes, in its own dim order, and the placement of each;
    then the whole mesh and its placements (``Replicate`` where the mapping names no axis)."""
    expert_names = mesh_context.fsdp_moe_mesh.mesh_dim_names or () if mesh_context.fsdp_moe_mesh is not None else ()
    dims = {axis: axis if axis in expert_names else mesh_context.dim_name(axis) for axis in named}
    expert = [axis for axis in named if axis in expert_names]
    device = [axis for axis in named if axis not in expert and dims[axis] is not None]
    missing = [axis for axis in named if dims[axis] is None]
    if missing:
        available = [*(mesh_context.device_mesh.mesh_dim_names or ()), *expert_names]
        problems.append(f"{fqn!r} is placed on {missing}, which no mesh has (axes: {', '.join(available)})")
        return None
    if expert and device:
        problems.append(
            f"{fqn!r} is placed on {expert} of the expert mesh and {device} of the device mesh at once: "
            "one parameter lives on one mesh"
        )
        return None
    mesh = mesh_context.fsdp_moe_mesh if expert else mesh_context.device_mesh
    assert mesh is not None
    order = mesh.mesh_dim_names or ()
    by_dim = {dims[axis]: placement for axis, placement in named.items()}
    whole = tuple(by_dim.get(dim, Replicate()) for dim in order)
    axes = tuple(dim for dim in order if dim in by_dim)
    if not axes:  # a mapping that names no axis replicates over the whole device mesh
        return mesh, whole, mesh, whole
    if axes not in slices:
        slices[axes] = mesh[axes]
    return slices[axes], tuple(by_dim[dim] for dim in axes), mesh, whole


def _parameter(module: nn.Module, path: str) -> nn.Parameter | None:
    owner_path, _, name = path.rpartition(".")
    try:
        owner = module.get_submodule(owner_path) if owner_path else module
    except AttributeError:
        return None
    parameter = owner._parameters.get(name)
    return parameter if isinstance(parameter, nn.Parameter) else None


def _already_there(entry: _Planned) -> bool:
    """Whether the parameter already is a DTensor on this mesh with these placements."""
    parameter = entry.parameter
    return isinstance(parameter, DTensor) and parameter.device_mesh == entry.mesh and parameter.placements == entry.placements


def _record_families(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> None:
    for fqn, spec in plan.parallel_modules.items():
        module = submodule(model, fqn)
        if isinstance(family_spec(type(module)), ParallelModuleSpec):
            record_family_distribution(module, fqn, spec, plan.sharding[fqn], mesh_context)
