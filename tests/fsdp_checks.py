"""SPEC §10 FSDP2 on real process groups, run on every rank by test_fsdp.py: ``apply_fully_shard``
after ``apply_layouts`` on the prebuilt meshes; the report's bytes are each rank's real storage."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from meshbind import (
    FullyShard,
    LayoutError,
    MeshContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    UnitPrecision,
    apply_fully_shard,
    apply_layouts,
    plan_report,
    resolve_plan,
)
from meshbind.resolution.plan import ParallelPlan

from rank_checks import Results, attempt_each, process_group_count

SPEC = ParallelModuleSpec("fsdp_test")
UNITS = FullyShard(("blocks.*.experts", "blocks.*"))


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Attention(nn.Module):
    """30 rows over tp=2 are 15 per rank, which FSDP over 2 ranks splits 8 / 7 (8 allocated)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 30, bias=False)
        self.out = nn.Linear(30, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(nn.functional.linear(x, local(self.proj.weight)), local(self.out.weight))


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ local(self.w).sum(0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.attn = Attention()
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.attn(self.norm(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _heads(module: nn.Module | None, fqn: str, context: object) -> ModuleShardingSpec:
    return ModuleShardingSpec(params={"proj.weight": {"tp": Shard(0)}, "out.weight": {"tp": Shard(1)}})


def _experts(module: nn.Module | None, fqn: str, context: object) -> ModuleShardingSpec:
    return ModuleShardingSpec(params={"w": {"ep": Shard(0)}})


REQUESTS = [
    NativeParallelBindingRequest(("blocks.*.attn",), SPEC, _heads),
    NativeParallelBindingRequest(("blocks.*.experts",), SPEC, _experts),
]


def _model_and_plan(context: MeshContext) -> tuple[Model, ParallelPlan]:
    torch.manual_seed(0)
    model = Model()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return model, resolve_plan(model, REQUESTS, context.layout_context(), fully_shard=UNITS)


def _storage(tensor: torch.Tensor) -> int:
    return local(tensor).untyped_storage().nbytes()


def check_bytes(context: MeshContext) -> None:
    """Parameters' and gradients' storage on this rank equals the report's, padding included."""
    model, plan = _model_and_plan(context)
    report = plan_report(model, plan, optimizer="none").ranks[torch.distributed.get_rank()]
    apply_layouts(model, plan, context)
    apply_fully_shard(model, plan, context)
    held = sum(_storage(parameter) for parameter in model.parameters())
    assert held == report.parameter_bytes, (held, report.parameter_bytes)
    proj = model.blocks[0].attn.proj.weight
    assert isinstance(proj, DTensor)
    coordinates = context.world.coordinates(torch.distributed.get_rank())
    fsdp_index = coordinates["dp_shard"] * context.world.cp + coordinates["cp"]
    rows = 30 // context.world.tp
    chunk = -(-rows // context.world.fsdp_shard)
    held_rows = min(chunk, rows - fsdp_index * chunk)
    assert local(proj).shape == (held_rows, 16) and _storage(proj) == chunk * 16 * 4, (local(proj).shape, _storage(proj))
    model(torch.ones(3, 16)).sum().backward()
    # FSDP's gradients are views of one reduce-scatter buffer per unit: each storage counts once.
    storages = {local(p.grad).untyped_storage().data_ptr(): _storage(p.grad) for p in model.parameters() if p.grad is not None}
    gradients = sum(storages.values())
    assert gradients == report.gradient_bytes, (gradients, report.gradient_bytes)


def check_no_group_and_twice(context: MeshContext) -> None:
    model, plan = _model_and_plan(context)
    apply_layouts(model, plan, context)
    before = process_group_count()
    assert apply_fully_shard(model, plan, context) == ["blocks.0.experts", "blocks.1.experts", "blocks.0", "blocks.1", "<root>"]
    assert process_group_count() == before
    parameters = list(model.parameters())
    assert apply_fully_shard(model, plan, context) == []
    assert all(a is b for a, b in zip(parameters, model.parameters(), strict=True))
    expert = model.blocks[0].experts.w
    assert isinstance(expert, DTensor) and expert.device_mesh.mesh_dim_names[-1] == "ep"


def check_refused_before_anything(context: MeshContext) -> None:
    model, plan = _model_and_plan(context)
    try:
        apply_fully_shard(model, plan, context)  # the layouts were not applied
    except LayoutError as error:
        assert "'blocks.0.attn.proj.weight' is planned but not distributed yet" in str(error), str(error)
    else:
        raise AssertionError("apply_fully_shard took a model whose layouts were not applied")
    assert not any(isinstance(module, FSDPModule) for module in model.modules())


NORMS_IN_FLOAT32 = UnitPrecision("blocks.*.norm", param_dtype=torch.float32, output_dtype=torch.bfloat16)
MIXED = FullyShard(
    ("blocks.*.experts", "blocks.*.norm", "blocks.*"), param_dtype="bf16", reduce_dtype="fp32", unit_policies=(NORMS_IN_FLOAT32,)
)


def check_mixed_precision(context: MeshContext) -> None:
    """torch's own policy on every unit: the forward sees bfloat16 weights (gathered and cast),
    the sharded parameters and their reduced gradients stay float32, the output is bfloat16; the
    norms, units of their own policy, compute in float32 and hand bfloat16 on."""
    torch.manual_seed(0)
    model = Model()
    plan = resolve_plan(model, REQUESTS, context.layout_context(), fully_shard=MIXED)
    apply_layouts(model, plan, context)
    apply_fully_shard(model, plan, context)
    norms = [model.blocks[0].norm, model.blocks[1].norm]
    units = [model.blocks[0].experts, model.blocks[1].experts, *norms, model.blocks[0], model.blocks[1], model]
    for unit in units:
        assert isinstance(unit, FSDPModule)
        policy = unit._get_fsdp_state()._mp_policy
        wanted = (torch.float32, None, torch.bfloat16) if unit in norms else (torch.bfloat16, torch.float32, None)
        assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == wanted, policy
    seen: list[tuple[str, str, torch.dtype]] = []  # (module, what, dtype) as the forward meets them
    for name, module in (("norm", model.blocks[0].norm), ("head", model.head)):
        # FSDP's own hooks, registered first, have gathered and cast before these run
        module.register_forward_pre_hook(
            lambda module, args, name=name: seen.extend([(name, "input", args[0].dtype), (name, "weight", module.weight.dtype)])
        )
        module.register_forward_hook(lambda module, args, out, name=name: seen.append((name, "output", out.dtype)))
    output = model(torch.ones(3, 16))
    assert output.dtype == torch.bfloat16, output.dtype
    f32, bf16 = torch.float32, torch.bfloat16
    assert seen == [
        *[("norm", "input", f32), ("norm", "weight", f32), ("norm", "output", bf16)],
        *[("head", "input", bf16), ("head", "weight", bf16), ("head", "output", bf16)],
    ], seen
    output.float().sum().backward()
    reported, torchs = _report_units(plan_report(model, plan)), _torch_units(units)
    assert reported == torchs, (reported, torchs)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}


def _report_units(report: object) -> tuple[int, int, int]:
    """The report's shards, gathered copies and reduce-scatter buffers of every unit on this rank."""
    units = report.units  # type: ignore[attr-defined]
    shards, gathered, reduced = (sum(getattr(u, name) * u.count for u in units) for name in _UNIT_BYTES)
    return shards, gathered, reduced


_UNIT_BYTES = ("shard_bytes", "gathered_bytes", "reduce_scatter_bytes")


def _torch_units(units: list[nn.Module]) -> tuple[int, int, int]:
    """The same from torch's own FSDP parameters: each shard's padded size times the ranks, in the
    dtype torch all-gathers and reduces it in."""
    shards = gathered = reduced = 0
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
        for param in group.fsdp_params:
            unsharded = param.padded_sharded_param_size.numel() * group.mesh_info.shard_mesh_size
            compute = param.param_dtype or param.orig_dtype
            shards += param._sharded_param_data.numel() * param.orig_dtype.itemsize
            gathered += unsharded * compute.itemsize
            reduced += unsharded * (param.reduce_dtype or compute).itemsize if param.sharded_param.requires_grad else 0
    return shards, gathered, reduced


def run_checks(sizes: dict[str, int]) -> Results:
    context = MeshContext.build(**sizes)
    return attempt_each(
        {
            "bytes": lambda: check_bytes(context),
            "mixed_precision": lambda: check_mixed_precision(context),
            "no_group_and_twice": lambda: check_no_group_and_twice(context),
            "refused_before_anything": lambda: check_refused_before_anything(context),
        }
    )


UNITS_DEMO = FullyShard(("blocks.*.moe", "blocks.*"))
