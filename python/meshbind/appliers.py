"""Applying a resolved plan's layouts and bindings to a model, by the source its plan came from.

Each plan source (``specs.PlanSource``: meshbind's own requests, torch's ``parallelize_module``
plans, transformers' plans) resolves to modules of its own protocol, and each protocol has one
applier here: a new source (the pipeline's stages) adds an entry, not a branch in its callers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from torch import nn

from meshbind.binding import bind_parallel_modules
from meshbind.interop import HF_PROTOCOL, torch_plans
from meshbind.layouts import apply_layouts
from meshbind.mesh import MeshContext
from meshbind.resolution.plan import ParallelPlan

PlanApplier = Callable[[nn.Module, ParallelPlan, MeshContext], None]
"""``applier(model, plan, mesh_context)``: the plan's layouts and bindings, applied in place."""


def _meshbind_requests(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> None:
    """meshbind's own plans: the DTensor layouts, then each module bound to its meshes."""
    apply_layouts(model, plan, mesh_context)
    bind_parallel_modules(model, plan, mesh_context)


def _torch_plan(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> None:
    """torch's ``parallelize_module`` plans, on the ``tp`` mesh."""
    torch_plans.parallelize_checked(model, plan, mesh_context.device_mesh["tp"], group=mesh_context.stage_group)


def _transformers_plan(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> None:
    """transformers' own plans, with its EP dispatch under the routing a trace assumes."""
    from meshbind.interop import hf_plans, hf_routing  # transformers, loaded only for its own plans

    world = mesh_context.world
    ep_mesh = mesh_context.fsdp_moe_mesh["ep"] if mesh_context.fsdp_moe_mesh is not None and world.ep > 1 else None
    tp_mesh = mesh_context.device_mesh["tp"]
    hf_plans.apply_hf_plan(
        model,
        plan,
        tp_mesh=tp_mesh,
        ep_mesh=ep_mesh,
        ep_implementation=hf_routing.ASSUMED_ROUTING_EP,
        group=mesh_context.stage_group,
    )


APPLIERS: Mapping[str, PlanApplier] = MappingProxyType({HF_PROTOCOL: _transformers_plan, torch_plans.PROTOCOL: _torch_plan})
"""The applier of each source's protocol; a plan with neither is meshbind's own."""


def apply_parallelism(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> None:
    """The plan's layouts and bindings, by the applier of its source. A plan is read from one
    source (``resolve_plan`` takes one ``PlanSource``); a plan mixing two is a ``ValueError``."""
    sources = {spec.protocol for spec in plan.parallel_modules.values() if spec.protocol in APPLIERS}
    if len(sources) > 1:
        raise ValueError(f"the plan mixes modules of the protocols {sorted(sources)}: apply each source's plan on its own")
    applier = APPLIERS[sources.pop()] if sources else _meshbind_requests
    applier(model, plan, mesh_context)
