"""``MoELayer``: a family module owning the ``ep`` protocol over fused ``[E, ...]`` expert weights."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshbind.binding import ParallelBinding
from meshbind.ep import EPContext
from meshbind.examples.parallel_parts import local, require_binding
from meshbind.specs import LayoutContext, ModuleShardingSpec, ParallelModuleSpec


def _check_experts(*, module: nn.Module, sharding: ModuleShardingSpec, context: LayoutContext) -> None:
    assert isinstance(module, MoELayer)
    if not 1 <= module.top_k <= module.num_experts:
        raise ValueError(f"top_k {module.top_k} must lie in [1, {module.num_experts}]")


def _experts_materialized(*, module: nn.Module, binding: ParallelBinding | None) -> None:
    assert isinstance(module, MoELayer)
    expected = module.num_experts if module.ep is None else module.ep.num_local_experts
    for name in MoELayer.EXPERT_WEIGHTS:
        weight = getattr(module, name)
        experts = _experts_computed(weight)
        if weight.is_meta or experts != expected:
            raise ValueError(f"{name} computes with {experts} local experts on {weight.device}, expected {expected} materialised")


def _experts_computed(weight: torch.Tensor) -> int:
    """The experts a rank computes with: the fused weight's experts split over its mesh's ``ep``
    dim (FSDP may hold fewer between steps; it gathers them for the forward)."""
    if not isinstance(weight, DTensor):
        return weight.size(0)
    names = weight.device_mesh.mesh_dim_names or ()
    if "ep" not in names:
        return weight.size(0)
    ep = names.index("ep")
    return weight.size(0) // weight.device_mesh.size(ep) if weight.placements[ep].is_shard(0) else weight.size(0)


class MoELayer(nn.Module):
    """Top-k routed SwiGLU experts with fused ``[E, ...]`` weights. A family per expert count: use
    ``moe_layer_class(num_experts)``, whose ``parallel_spec`` carries ``num_experts``."""

    EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
    parallel_spec: ParallelModuleSpec

    def __init__(self, hidden: int, intermediate: int, top_k: int) -> None:
        super().__init__()
        self.num_experts: int = self.parallel_spec.options["num_experts"]
        self.top_k = top_k
        self.router = nn.Linear(hidden, self.num_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(self.num_experts, intermediate, hidden))
        self.w_up = nn.Parameter(torch.empty(self.num_experts, intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(self.num_experts, hidden, intermediate))
        self.ep: EPContext | None = None

    def parallel_sharding(self, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        params: dict[str, dict[str, Any]] = {name: {"ep": Shard(0)} for name in self.EXPERT_WEIGHTS}
        params["router.weight"] = {"ep": Replicate()}
        return ModuleShardingSpec(params=params)

    def bind_parallel(self, binding: ParallelBinding) -> None:
        """The experts this rank owns are its weights' local shards (``apply_layouts`` made them)."""
        self.ep = require_binding(self, binding, "ep_context")

    def unbind_parallel(self) -> None:
        self.ep = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts of each token and their renormalised weights."""
        weights, expert_ids = torch.softmax(nn.functional.linear(x, local(self.router.weight)), dim=-1).topk(self.top_k, dim=-1)
        return expert_ids, weights / weights.sum(dim=-1, keepdim=True)

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> Any:
        assert self.ep is not None
        return self.ep.dispatch(tokens, expert_ids)

    def compute(self, tokens: torch.Tensor, local_expert_ids: torch.Tensor) -> torch.Tensor:
        """Each token through its local expert, a SwiGLU over the fused weights' local experts."""
        gate = torch.einsum("th,tih->ti", tokens, local(self.w_gate)[local_expert_ids])
        up = torch.einsum("th,tih->ti", tokens, local(self.w_up)[local_expert_ids])
        return torch.einsum("ti,thi->th", nn.functional.silu(gate) * up, local(self.w_down)[local_expert_ids])

    def combine(self, expert_out: torch.Tensor, routed: Any, weights: torch.Tensor) -> torch.Tensor:
        assert self.ep is not None
        return self.ep.combine(expert_out, routed, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.size(-1))
        expert_ids, weights = self.route(x=tokens)
        if self.ep is None:
            out = self.compute(tokens=tokens.repeat_interleave(self.top_k, dim=0), local_expert_ids=expert_ids.reshape(-1))
            combined = (out.view(-1, self.top_k, out.size(-1)) * weights.unsqueeze(-1)).sum(dim=1)
        else:
            routed = self.dispatch(tokens=tokens, expert_ids=expert_ids)
            expert_out = self.compute(tokens=routed.tokens, local_expert_ids=routed.local_expert_ids)
            combined = self.combine(expert_out=expert_out, routed=routed, weights=weights)
        return combined.view_as(x)


@functools.cache
def moe_layer_class(num_experts: int) -> type[MoELayer]:
    """The ``MoELayer`` family for ``num_experts`` (one class per count, made once)."""
    spec = ParallelModuleSpec(
        "ep_moe",
        "ep",
        stages={
            "route": ("x",),
            "dispatch": ("tokens", "expert_ids"),
            "compute": ("tokens", "local_expert_ids"),
            "combine": ("expert_out", "routed", "weights"),
        },
        validate=_check_experts,
        options={"num_experts": num_experts},
        validate_materialized=_experts_materialized,
    )
    return type(f"MoELayer{num_experts}", (MoELayer,), {"parallel_spec": spec, "__module__": __name__})
