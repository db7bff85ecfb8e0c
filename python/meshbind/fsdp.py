"""FSDP2 from the plan: torch's own ``fully_shard`` on the prebuilt meshes, after the
TP/EP layouts and binding, one call per unit of ``plan.fsdp``, bottom-up, the root last.

Resolution already refused what ``fully_shard`` cannot take. Here every unit is checked against
the model as it is now (its layouts applied, no unit sharded on another mesh) before the first
call, so a refusal changes nothing. A unit already sharded by this plan on the same mesh is left
alone: applying the plan twice changes nothing. No process group is made: the meshes FSDP
shards over were made with the ``MeshContext``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from meshbind.agreement import check_ranks_agree, plan_agreement
from meshbind.errors import LayoutError
from meshbind.layouts import check_application
from meshbind.mesh import MeshContext
from meshbind.modules import submodule
from meshbind.placements import shard_dim
from meshbind.resolution.fsdp import FSDPUnit
from meshbind.resolution.plan import ParallelPlan


def apply_fully_shard(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> list[str]:
    """Apply ``fully_shard`` to every unit of ``plan.fsdp`` (``"<root>"`` for the root); returns the
    units sharded by this call. Raises ``LayoutError`` naming every problem before any unit
    changes."""
    check_application(model, plan, mesh_context)
    if plan.fsdp is None:
        raise ValueError("the plan has no FSDP units: resolve it with resolve_plan(..., fully_shard=FullyShard(units))")
    check_ranks_agree(
        "apply_fully_shard", lambda: plan_agreement(model, plan, mesh_context), model=model, group=mesh_context.stage_group
    )
    pending, problems = [], []
    for unit in plan.fsdp.units:
        module = _held_at(model, unit.fqn)
        mesh = mesh_context.fsdp_mesh(unit.mesh)
        if not isinstance(module, FSDPModule):
            pending.append((unit, module, mesh))
        elif module._get_fsdp_state()._fsdp_param_group is not None and _unit_mesh(module) != mesh:
            problems.append(f"{_name(unit)} is already sharded by FSDP on {_unit_mesh(module)}, not on {mesh}")
    if pending:
        problems += _undistributed(model, plan)
    if problems:
        raise LayoutError(problems)
    reshard = plan.fsdp.reshard_after_forward
    if reshard is None and plan.context.world.pp > 1:
        reshard = False  # torchtitan's default under a pipeline: a stage's microbatches reuse the gathered weights
    for unit, module, mesh in pending:
        # torch's default policy keeps every parameter's own dtype
        policy = unit.policy or MixedPrecisionPolicy()
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return [unit.fqn or "<root>" for unit, _, _ in pending]


def _held_at(model: nn.Module, fqn: str) -> nn.Module:
    """The module the model holds at ``fqn``: a torch wrapper there (activation checkpointing) is
    what FSDP shards, as torchtitan does, so that gathering runs outside the recomputed region."""
    if not fqn:
        return model
    parent_fqn, _, name = fqn.rpartition(".")
    held = submodule(model, parent_fqn)._modules.get(name)
    return held if held is not None else submodule(model, fqn)


def _undistributed(model: nn.Module, plan: ParallelPlan) -> list[str]:
    """FSDP composes with the layouts' DTensors: a parameter the plan shards must already be one.
    One the plan only replicates may stay a plain tensor, as transformers keeps its
    ``replicated_with_grad_allreduce`` norms: FSDP shards it over the data-parallel ranks alone."""
    problems = []
    for module_fqn, sharding in plan.sharding.items():
        for path, placements in sharding.params.items():
            if all(shard_dim(placement) is None for placement in placements.values()):
                continue
            fqn = f"{module_fqn}.{path}" if module_fqn else path
            owner_path, _, name = fqn.rpartition(".")
            parameter = submodule(model, owner_path)._parameters.get(name)
            if parameter is not None and not isinstance(parameter, DTensor):
                problems.append(f"{fqn!r} is planned but not distributed yet: apply_layouts before apply_fully_shard")
    return problems


def _unit_mesh(module: FSDPModule) -> DeviceMesh:
    group = module._get_fsdp_state()._fsdp_param_group
    assert group is not None
    mesh: DeviceMesh = group.mesh_info.mesh
    return mesh


def _name(unit: FSDPUnit) -> str:
    return repr(unit.fqn) if unit.fqn else "the root"
