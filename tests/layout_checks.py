"""SPEC §8 on real process groups, run on every rank by test_layouts.py: apply_layouts makes the
plan's placements DTensor parameters on the prebuilt meshes, all or nothing, creating no group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshbind import (
    LayoutContext,
    LayoutError,
    MeshContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    ParallelPlan,
    apply_layouts,
    get_family_build_info,
    resolve_plan,
)

from rank_checks import Results, attempt_each, process_group_count

SPEC = ParallelModuleSpec("layout_test")


class Block(nn.Module):
    """Attention-like projections for tp, fused experts for ep, and a tied pair."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 12, bias=False)
        self.out = nn.Linear(12, 8, bias=False)
        self.w_experts = nn.Parameter(torch.empty(experts, 4, 8))
        self.embed = nn.Embedding(6, 8)
        self.unembed = nn.Linear(8, 6, bias=False)
        self.unembed.weight = self.embed.weight  # tied, as a language model's head


class FusedExperts(nn.Module):
    """A family member: its class owns its protocol and layout."""

    parallel_spec = ParallelModuleSpec("layout_test_experts")

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(experts, 4))

    def parallel_sharding(self, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return ModuleShardingSpec(params={"w": {"ep": Shard(0)}})


def check_family(context: MeshContext) -> None:
    """The applied layout is recorded in the family build info (and a changed one is not)."""
    model = nn.Module()
    with torch.device("meta"):
        model.experts = FusedExperts(2 * context.axis_sizes()["ep"])
    plan = resolve_plan(model, [], context.layout_context())
    if get_family_build_info(model.experts).layout.distributed_on is not None:  # type: ignore[union-attr]
        raise AssertionError("distributed before apply_layouts")
    if apply_layouts(model, plan, context) != ["experts.w"]:
        raise AssertionError("the family member's parameter was not distributed")
    layout = get_family_build_info(model.experts).layout
    if layout is None or layout.distributed_on is not context or layout.sharding != plan.sharding["experts"]:
        raise AssertionError(f"build info after apply_layouts: {layout}")


def _request(match: str, params: dict[str, dict[str, Any]]) -> NativeParallelBindingRequest:
    return NativeParallelBindingRequest((match,), SPEC, lambda m, f, c: ModuleShardingSpec(params=params))


TP_AND_EP = {
    "qkv.weight": {"tp": Shard(0)},
    "out.weight": {"tp": Shard(1)},
    "w_experts": {"ep": Shard(0)},
    "embed.weight": {"tp": Replicate()},
}


def _model(experts: int, device: str) -> Block:
    with torch.device(device):
        model = Block(experts)
    return model


def check_meta(context: MeshContext) -> None:
    sizes = context.axis_sizes()
    model = _model(2 * sizes["ep"], "meta")
    plan = resolve_plan(model, [_request("", TP_AND_EP)], context.layout_context())
    model.qkv.weight.requires_grad_(False)
    before = process_group_count()
    distributed = apply_layouts(model, plan, context)
    if process_group_count() != before:
        raise AssertionError(f"apply_layouts created {process_group_count() - before} groups")
    if distributed != ["qkv.weight", "out.weight", "w_experts", "embed.weight"]:
        raise AssertionError(f"distributed {distributed}")
    expected = {
        "qkv.weight": ((Shard(0),), (12 // sizes["tp"], 8)),
        "out.weight": ((Shard(1),), (8, 12 // sizes["tp"])),
        "w_experts": ((Shard(0),), (2, 4, 8)),
        "embed.weight": ((Replicate(),), (6, 8)),
    }
    for name, (placements, local_shape) in expected.items():
        parameter = model.get_parameter(name)
        if not (isinstance(parameter, nn.Parameter) and isinstance(parameter, DTensor)):
            raise AssertionError(f"{name} is a {type(parameter).__name__}, not a DTensor parameter")
        if parameter.placements != placements or tuple(parameter.to_local().shape) != local_shape or not parameter.is_meta:
            raise AssertionError(f"{name}: {parameter.placements} local {tuple(parameter.to_local().shape)}")
        if parameter.dtype != torch.float32:
            raise AssertionError(f"{name} changed dtype to {parameter.dtype}")
    if model.qkv.weight.requires_grad or not model.out.weight.requires_grad:
        raise AssertionError("requires_grad was not kept")
    if model.w_experts.device_mesh.mesh_dim_names != ("ep",) or model.qkv.weight.device_mesh.mesh_dim_names != ("tp",):
        raise AssertionError("the meshes are not the prebuilt ones sliced to the named axes")
    if model.unembed.weight is not model.embed.weight:
        raise AssertionError("the tie did not survive")
    # Twice is a no-op; then materialise as torchtitan does.
    if apply_layouts(model, plan, context) != []:
        raise AssertionError("applying the same plan twice distributed again")
    model.to_empty(device="cpu")
    if model.w_experts.to_local().shape != (2, 4, 8) or model.w_experts.is_meta:
        raise AssertionError("to_empty did not give real shards")


def check_values(context: MeshContext) -> None:
    """With values, each rank's shard comes from rank 0's full tensor."""
    sizes = context.axis_sizes()
    model = _model(2 * sizes["ep"], "cpu")
    torch.manual_seed(1234 + dist.get_rank())  # every rank different: only rank 0's may show
    for parameter in model.parameters():
        nn.init.normal_(parameter)
    full = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, full)
    rank0 = gathered[0]
    assert rank0 is not None
    plan = resolve_plan(model, [_request("", TP_AND_EP)], context.layout_context())
    apply_layouts(model, plan, context)
    for name, parameter in model.named_parameters():
        value = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter.detach()
        if not torch.equal(value, rank0[name]):
            raise AssertionError(f"{name} is not rank 0's tensor")


def check_all_or_nothing(context: MeshContext) -> None:
    sizes = context.axis_sizes()
    layout = context.layout_context()

    def expect(model: Block, plan: ParallelPlan, *texts: str) -> None:
        before = {name: parameter for name, parameter in model.named_parameters(remove_duplicate=False)}
        try:
            apply_layouts(model, plan, context)
        except LayoutError as error:
            missing = [text for text in texts if text not in str(error)]
            if missing or error.code != "layout" or not isinstance(error, ValueError):
                raise AssertionError(f"{missing} not in {error}") from error
        else:
            raise AssertionError(f"no LayoutError ({texts})")
        after = dict(model.named_parameters(remove_duplicate=False))
        if after.keys() != before.keys() or any(after[name] is not before[name] for name in before):
            raise AssertionError("a failed apply_layouts changed a parameter")

    experts = 2 * sizes["ep"]
    # Axes of both meshes in one mapping (resolution accepts it: both axes are the context's).
    both = _request("", {"qkv.weight": {"tp": Shard(0)}, "w_experts": {"ep": Shard(0), "dp": Replicate()}})
    model = _model(experts, "meta")
    expect(model, resolve_plan(model, [both], layout), "'w_experts' is placed on ['ep'] of the expert mesh and ['dp']")
    # An axis no mesh has: a plan built by hand for these axes names one.
    model = _model(experts, "meta")
    plan = resolve_plan(model, [_request("", TP_AND_EP)], layout)
    sharding = {**plan.sharding, "": ModuleShardingSpec(params={"qkv.weight": {"tp": Shard(0)}, "out.weight": {"pp": Shard(0)}})}
    expect(model, ParallelPlan(plan.parallel_modules, sharding, plan.context, plan.sources), "'out.weight' is placed on ['pp']")
    # A tie given two layouts.
    model = _model(experts, "meta")
    tied = [_request("embed", {"weight": {"tp": Replicate()}}), _request("unembed", {"weight": {"tp": Shard(0)}})]
    expect(model, resolve_plan(model, tied, layout), "'unembed.weight' is the parameter 'embed.weight' (tied)")
    # Already distributed with another layout.
    model = _model(experts, "meta")
    apply_layouts(model, resolve_plan(model, [_request("", TP_AND_EP)], layout), context)
    other = _request("", {**TP_AND_EP, "qkv.weight": {"tp": Replicate()}})
    expect(model, resolve_plan(model, [other], layout), "'qkv.weight' is already distributed as (Shard(dim=0),)")


def run_checks(sizes: dict[str, int]) -> Results:
    context = MeshContext.build(**sizes)
    return attempt_each(
        {
            "meta": lambda: check_meta(context),
            "values": lambda: check_values(context),
            "all_or_nothing": lambda: check_all_or_nothing(context),
            "family": lambda: check_family(context),
        }
    )
