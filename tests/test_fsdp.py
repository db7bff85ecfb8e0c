"""SPEC §10 FSDP2: units resolved from the plan, every unit fully_shard would refuse refused first,
the report's padded bytes, and (on gloo worlds, fsdp_checks.py) the bytes each rank really holds."""

from __future__ import annotations

import pytest

from rank_checks import failures_of, world_results_fixture

WORLDS = {
    "4 ranks dp_shard2 tp2 ep2 (15 rows split 8 / 7)": (4, {"dp_shard": 2, "tp": 2, "ep": 2}),
    "4 ranks HSDP dp_replicate2 dp_shard2 ep2": (4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}),
}
CHECKS = ("bytes", "mixed_precision", "no_group_and_twice", "refused_before_anything")

world_results = world_results_fixture(WORLDS, "fsdp_checks:run_checks")


@pytest.mark.parametrize("check", CHECKS)
def test_check_passes_on_every_rank(world_results: list[dict[str, str | None]], check: str) -> None:
    failures = failures_of(world_results, check)
    assert not failures, failures


# Resolution: the units, their meshes, and every unit fully_shard would refuse, before anything changes.

import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import fsdp_checks  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402

from meshbind import (  # noqa: E402
    FullyShard,
    LayoutContext,
    NativeParallelBindingRequest,
    PlanError,
    plan_report,
    resolve_plan,
)
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request  # noqa: E402

AXES = {"dp_shard": 2, "cp": 2, "tp": 2, "ep": 4}


def demo_model() -> MoETransformer:
    with torch.device("meta"):
        return MoETransformer(TransformerConfig(layers=2, experts=8))


def fsdp_problems(
    model: nn.Module, units: tuple[str, ...], requests: list[NativeParallelBindingRequest] | None = None
) -> list[str]:
    with pytest.raises(PlanError) as refused:
        resolve_plan(
            model, [loss_head_request()] if requests is None else requests, LayoutContext(AXES), fully_shard=FullyShard(units)
        )
    return [problem.line() for problem in refused.value.problems]


def test_units_go_bottom_up_then_the_root_each_on_its_mesh() -> None:
    plan = resolve_plan(
        demo_model(), [loss_head_request()], LayoutContext(AXES), fully_shard=FullyShard(("blocks.*", "blocks.*.moe"))
    )
    assert plan.fsdp is not None
    assert [(unit.fqn, unit.mesh) for unit in plan.fsdp.units] == [
        ("blocks.0.moe", "expert"),
        ("blocks.1.moe", "expert"),
        ("blocks.0", "device"),
        ("blocks.1", "device"),
        ("", "device"),
    ]
    assert plan.fsdp.unit_of("blocks.1.moe.router.weight").fqn == "blocks.1.moe"
    assert plan.fsdp.unit_of("blocks.1.attn.qkv.weight").fqn == "blocks.1" and plan.fsdp.unit_of("embed.weight").fqn == ""
    assert "FSDP units, in the order fully_shard takes them: blocks.<0-1>.moe (expert), blocks.<0-1> (device)" in plan.explain()
    assert plan.to_dict()["fsdp"]["units"][-1] == {"fqn": "", "mesh": "device", "mixed_precision": None}


def test_a_unit_pattern_that_selects_nothing_says_what_it_meant() -> None:
    (line,) = fsdp_problems(demo_model(), ("block.*", "blocks.*.moe"))
    assert line.startswith("unmatched (pattern): pattern 'block.*' does not select any module; did you mean 'blocks.0'")


def test_a_container_is_refused_as_a_unit() -> None:
    lines = fsdp_problems(demo_model(), ("blocks.*.moe", "blocks"))
    assert lines == [
        "fsdp      'blocks': is a ModuleList, which fully_shard refuses (it has no forward to hook): "
        "name its members as units (blocks.*) [fully_shard]"
    ]


def test_a_unit_holding_parameters_of_both_meshes_is_refused() -> None:
    lines = fsdp_problems(demo_model(), ("blocks.*",))
    assert [line.replace("blocks.1", "blocks.0") for line in lines] == [lines[0]] * 2  # alike: one line in the text
    assert lines[0].startswith(
        "fsdp      'blocks.0': holds parameters of the expert mesh ('moe.w_gate') and of the device mesh ('attn_norm.weight')"
    )
    assert "make the expert module a unit of its own" in lines[0]


def test_a_parameter_placed_on_an_axis_fsdp_shards_over_is_refused() -> None:
    # The demo's attention once named cp: Replicate() on its weights, which FSDP's dp_shard_cp axis also covers.
    overrides = {"blocks.*.attn": {"params": {"qkv.weight": {"cp": Replicate(), "tp": Shard(0)}, "out.weight": {}}}}
    with pytest.raises(PlanError) as refused:
        resolve_plan(
            demo_model(), [loss_head_request()], LayoutContext(AXES), overrides=overrides, fully_shard=fsdp_checks.UNITS_DEMO
        )
    lines = [problem.line() for problem in refused.value.problems]
    assert any(
        line.startswith(
            "fsdp      'blocks.0.attn.qkv.weight': is placed on ['cp']: in an FSDP unit a parameter may be placed on 'tp' only"
        )
        for line in lines
    ), lines
    assert any(line.startswith("fsdp      'blocks.0.attn.out.weight': is placed on no axis") for line in lines), lines


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_tie_across_units_a_scalar_and_mixed_dtypes_are_refused() -> None:
    model = Tied()
    model.blocks[0].scale = nn.Parameter(torch.tensor(1.0))
    model.blocks[1].half()
    model.blocks[1].weight = nn.Parameter(model.blocks[1].weight.float())
    lines = fsdp_problems(model, ("head", "blocks.*"), [])
    assert lines == [
        "fsdp      'blocks.0.scale': is a 0-d parameter: FSDP shards dim 0, which it does not have [fully_shard]",
        "fsdp      'blocks.1': holds parameters of 2 dtypes (float16, float32): "
        "FSDP all-gathers a unit in one dtype [fully_shard]",
        "fsdp      'head.weight': is tied to 'embed.weight', which the FSDP unit <root> holds, while the unit 'head' holds it: "
        "FSDP shards a parameter in one unit; make both one unit [fully_shard]",
    ]
    resolve_plan(Tied(), [], LayoutContext(AXES), fully_shard=FullyShard(()))  # the root alone holds both sides of the tie


def test_the_report_counts_the_padded_chunk_fsdp_allocates() -> None:
    # 30 rows over tp=2 are 15 per rank; FSDP over dp_shard=2 keeps ceil(15 / 2) = 8 on every rank.
    model = fsdp_checks.Model()
    context = LayoutContext({"dp_shard": 2, "tp": 2, "ep": 2})
    plan = resolve_plan(model, fsdp_checks.REQUESTS, context, fully_shard=fsdp_checks.UNITS)
    report = plan_report(model, plan, optimizer="adam")
    rows = {row.fqn: row for row in report.params}
    proj = rows["blocks.0.attn.proj.weight"]
    assert (proj.local_shape, proj.bytes_per_rank, proj.fsdp_shards) == ((8, 16), 8 * 16 * 4, 2)
    experts = rows["blocks.0.experts.w"]  # 4 experts over ep=2, then edp_shard = 2 * 2 / 2 = 2
    assert (experts.local_shape, experts.fsdp_shards) == ((1, 16, 16), 2)
    head_bias = rows["head.bias"]  # 5 over 2: 3 allocated
    assert head_bias.local_shape == (3,)
    expected = sum(math.prod(row.local_shape) * 4 for row in report.params)
    rank = report.ranks[3]
    assert (rank.parameter_bytes, rank.gradient_bytes, rank.optimizer_bytes) == (expected, expected, 2 * expected)
    assert "fsdp/2" in report.text() and report.to_dict()["params"][0]["fsdp_shards"] == 2


def test_hsdp_replicas_hold_the_same_chunk() -> None:
    model = fsdp_checks.Model()
    sharded = resolve_plan(
        model, fsdp_checks.REQUESTS, LayoutContext({"dp_shard": 2, "tp": 1, "ep": 2}), fully_shard=fsdp_checks.UNITS
    )
    hybrid = resolve_plan(
        model, fsdp_checks.REQUESTS, LayoutContext({"dp": 2, "dp_shard": 2, "tp": 1, "ep": 2}), fully_shard=fsdp_checks.UNITS
    )
    assert plan_report(model, hybrid).ranks[3].total_bytes == plan_report(model, sharded).ranks[1].total_bytes
    assert len(plan_report(model, hybrid).ranks) == 4


def test_dp_shard_alone_shards_over_torchtitans_default_units() -> None:
    """dp_shard means FSDP, as in torchtitan: with no units named, each block, each expert module
    on ep, then the root; the plan and the report say they were chosen by default."""
    axes = {"dp_shard": 4, "cp": 2, "tp": 2, "ep": 2}
    defaulted = resolve_plan(demo_model(), [loss_head_request()], LayoutContext(axes))
    units = FullyShard(("blocks.*.moe", "blocks.*"))
    named = resolve_plan(demo_model(), [loss_head_request()], LayoutContext(axes), fully_shard=units)
    assert defaulted.fsdp is not None and named.fsdp is not None
    assert defaulted.fsdp.by_default and not named.fsdp.by_default
    assert defaulted.fsdp.units == named.fsdp.units
    dense = LayoutContext({"cp": 2, "tp": 2, "ep": 2})
    replicated = plan_report(demo_model(), resolve_plan(demo_model(), [loss_head_request()], dense))
    report = plan_report(demo_model(), defaulted)
    assert report.totals() == plan_report(demo_model(), named).totals()
    assert report.totals()["total_bytes_per_rank"] < replicated.totals()["total_bytes_per_rank"] / 3
    line = "FSDP units (none named: torchtitan's default units), in the order fully_shard takes them: "
    assert line + "blocks.<0-1>.moe (expert), blocks.<0-1> (device), <root> (device)" in defaulted.explain()
    assert line in report.text() and report.to_dict()["fsdp_units"].startswith(line)
    assert defaulted.to_dict()["fsdp"]["by_default"] is True


def test_default_units_of_a_model_without_a_layer_list_are_the_root_and_their_problems_say_so() -> None:
    flat = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = resolve_plan(flat, [], LayoutContext({"dp_shard": 2}))
    assert plan.fsdp is not None and [unit.fqn for unit in plan.fsdp.units] == [""]
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64))
    with pytest.raises(PlanError) as refused:
        resolve_plan(mixed, [], LayoutContext({"dp_shard": 2}))
    assert "holds parameters of 2 dtypes" in str(refused.value) and "[fully_shard (default units)]" in str(refused.value)


def test_default_units_offline_are_the_blocks_of_the_most_numbered_list() -> None:
    layers = [f"layers.{i}{tail}" for i in range(3) for tail in ("", ".mlp")]
    names = ["", "embed", "layers", *layers, "heads", "heads.0"]
    plan = resolve_plan(names, [], LayoutContext({"dp_shard": 2}))
    assert plan.fsdp is not None and [unit.fqn for unit in plan.fsdp.units] == ["layers.0", "layers.1", "layers.2", ""]


def test_meshbind_check_report_at_dp_shard_alone_shards_a_transformers_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshbind.cli import main

    config = tmp_path / "llama.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 128}))  # fmt: skip
    assert main(["check", "--hf-config", str(config), "--axis", "dp_shard=4", "--report"]) == 0
    out = capsys.readouterr().out
    assert "fsdp/4" in out and "torchtitan's default units" in out and "model.layers.<0-1> (device)" in out


def test_mixed_precision_is_torchs_policy_on_every_unit_and_a_dtype_that_is_not_floating_is_named() -> None:
    import torch
    from fsdp_checks import REQUESTS, Model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from meshbind import FullyShard, LayoutContext, resolve_plan

    plan = resolve_plan(
        Model(),
        REQUESTS,
        LayoutContext({"dp_shard": 2, "tp": 2, "ep": 2}),
        fully_shard=FullyShard(None, param_dtype="bf16", reduce_dtype=torch.float32),
    )
    assert plan.fsdp is not None and plan.fsdp.by_default  # FullyShard(None): torchtitan's default units
    assert plan.fsdp.policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert plan.fsdp.to_dict()["mixed_precision"] == {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "output_dtype": None,
        "cast_forward_inputs": True,
    }
    assert "mixed precision param_dtype bfloat16, reduce_dtype float32" in plan.fsdp.describe()
    assert resolve_plan(Model(), REQUESTS, LayoutContext({"dp_shard": 2, "tp": 2, "ep": 2})).fsdp.policy is None  # type: ignore[union-attr]
    for field, value in [("param_dtype", torch.int8), ("reduce_dtype", "bf32"), ("output_dtype", 16)]:
        with pytest.raises(ValueError, match=rf"FullyShard\.{field} must be a floating torch\.dtype or one of bf16, bfloat16"):
            FullyShard(("blocks.*",), **{field: value})


def test_a_plan_under_another_plan_wide_policy_is_the_plan_those_dtypes_resolve_to() -> None:
    """The layout search resolves a world once and takes its other precisions by ``with_policy``:
    equal to resolving them afresh, a unit's own policy kept."""
    import torch
    from fsdp_checks import MIXED, REQUESTS, Model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from meshbind import FullyShard, LayoutContext, resolve_plan

    context = LayoutContext({"dp_shard": 2, "tp": 2, "ep": 2})
    for units in (None, MIXED.units):
        own = () if units is None else MIXED.unit_policies
        bf16 = resolve_plan(Model(), REQUESTS, context, fully_shard=FullyShard(units, param_dtype="bf16", unit_policies=own))
        fp32_units = FullyShard(units, param_dtype="fp32", reduce_dtype="fp32", unit_policies=own)
        fp32 = resolve_plan(Model(), REQUESTS, context, fully_shard=fp32_units)
        assert bf16.fsdp is not None and fp32.fsdp is not None and bf16.fsdp != fp32.fsdp
        assert bf16.fsdp.with_policy(MixedPrecisionPolicy(torch.float32, torch.float32)) == fp32.fsdp
        assert fp32.fsdp.with_policy(bf16.fsdp.policy) == bf16.fsdp
    kept = {unit.fqn: unit.policy for unit in bf16.fsdp.with_policy(None).units}
    assert kept["blocks.0.norm"] == MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    assert kept["blocks.0"] is None and kept[""] is None


def test_a_unit_policy_gives_the_units_it_selects_their_own_precision_and_every_misfit_is_named() -> None:
    import torch
    from fsdp_checks import MIXED, REQUESTS, Model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from meshbind import FullyShard, LayoutContext, PlanError, UnitPrecision, plan_report, resolve_plan

    context = LayoutContext({"dp_shard": 2, "tp": 2, "ep": 2})
    fsdp = resolve_plan(Model(), REQUESTS, context, fully_shard=MIXED).fsdp
    assert fsdp is not None
    own = MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16)
    policies = {unit.fqn: unit.policy for unit in fsdp.units}
    assert policies["blocks.0.norm"] == policies["blocks.1.norm"] == own
    assert policies["blocks.0"] == policies[""] == fsdp.policy == MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    assert "; blocks.<0-1>.norm: param_dtype float32, reduce_dtype None, output_dtype bfloat16" in fsdp.describe()
    units = {unit["fqn"]: unit for unit in fsdp.to_dict()["units"]}  # type: ignore[attr-defined]
    assert units["blocks.1.norm"]["mixed_precision"]["param_dtype"] == "float32"
    assert units["blocks.1"]["mixed_precision"]["param_dtype"] == "bfloat16"

    model = Model()
    report = plan_report(model, resolve_plan(model, REQUESTS, context, fully_shard=MIXED), optimizer="adam-fp32-master").text()
    assert "2 x blocks.<0-1>.norm (device)  float32 -> float32, reduced in float32  shards" in report
    assert "2 x blocks.<0-1> (device)  float32 -> bfloat16, reduced in float32  shards" in report
    assert "optimizer adam-fp32-master: under FSDP2 mixed precision the float32 shards are the master copy" in report

    unmatched = UnitPrecision("blocks.*.nrom", param_dtype="fp32")
    twice = UnitPrecision("blocks.<0-1>.norm", param_dtype="fp16")
    bad = FullyShard(MIXED.units, param_dtype="bf16", unit_policies=(*MIXED.unit_policies, unmatched, twice))
    with pytest.raises(PlanError) as refused:
        resolve_plan(Model(), REQUESTS, context, fully_shard=bad)
    message = str(refused.value)
    assert "fully_shard.unit_policies[1]" in message and "pattern 'blocks.*.nrom' selects no FSDP unit; did you mean" in message
    assert "blocks.<0-1>.norm" in message and "is selected by unit_policies [0, 2]: give each unit one policy" in message
    for wrong, words in [
        (dict(units=("blocks.*",)), "UnitPrecision.units must be one pattern str"),
        (dict(units="blocks.*", param_dtype=torch.int32), r"UnitPrecision\.param_dtype must be a floating torch\.dtype"),
        (dict(units="blocks.*", cast_forward_inputs="yes"), "UnitPrecision.cast_forward_inputs must be a bool"),
    ]:
        with pytest.raises(ValueError, match=words):
            UnitPrecision(**wrong)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"FullyShard\.unit_policies must be a tuple of UnitPrecision"):
        FullyShard(("blocks.*",), unit_policies=MIXED.unit_policies[0])  # type: ignore[arg-type]


def test_meshbind_check_takes_the_mixed_precision_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from meshbind.cli import main

    model = ["meshbind.examples.moe_transformer:MoETransformer", "meshbind.examples.moe_transformer:loss_head_request"]
    axes = ["--axis", "dp_shard=2", "--axis", "cp=1", "--axis", "tp=1", "--axis", "ep=2"]
    assert main(["check", *model, *axes, "--param-dtype", "bf16", "--reduce-dtype", "float32", "--json"]) == 0
    fsdp = json.loads(capsys.readouterr().out)["plan"]["fsdp"]
    assert fsdp["by_default"] and fsdp["mixed_precision"]["param_dtype"] == "bfloat16"
    with pytest.raises(SystemExit) as exited:
        main(["check", *model, *axes, "--param-dtype", "int8"])
    assert (
        exited.value.code == 2
        and "--param-dtype: invalid choice: 'int8' (choose from 'bf16', 'bfloat16'" in capsys.readouterr().err
    )
