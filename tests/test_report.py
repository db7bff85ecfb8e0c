"""plan_report and ``meshbind check --report/--json/--html/--checkpoint``: what each rank holds,
from the plan alone, on real model sizes; the page in a real headless Chromium; checkpoints
checked from their metadata."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from browser_pages import opened_page
from safetensors.torch import save_file
from torch import nn

from meshbind import FullyShard, LayoutContext, PlanError, from_hf_plan, plan_report, resolve_plan
from meshbind.cli import main
from meshbind.demo import run as demo
from meshbind.demo.config import DemoConfig
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.units import size_text

from hf_models import REAL, hf_model

DEMO = ["meshbind.examples.moe_transformer:MoETransformer", "meshbind.examples.moe_transformer:loss_head_request"]
DEMO_AXES = ["--axis", "dp=1", "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2"]
F32 = 4

# At tp=8 Qwen3-235B-A22B's 4 key/value heads would be split: the check refuses it (transformers #48307).
REAL_SIZES = {"deepseek_v3": {"tp": 8, "ep": 8}, "qwen3_moe_235b": {"cp": 2, "tp": 4, "ep": 8}, "llama_405b": {"tp": 8}}


@pytest.fixture(scope="module")
def real_models() -> dict[str, Any]:
    return {name: hf_model(name, real=True) for name in REAL_SIZES}


def row(report: Any, fqn: str) -> Any:
    return next(p for p in report.params if p.fqn == fqn)


@pytest.mark.parametrize("name", list(REAL_SIZES))
def test_the_report_counts_every_parameter_and_its_bytes_per_rank_by_hand(real_models: dict[str, Any], name: str) -> None:
    model, axes = real_models[name], REAL_SIZES[name]
    report = plan_report(model, resolve_plan(model, from_hf_plan(model), LayoutContext(axes)), optimizer="adam")
    assert report.parameter_count == sum(p.numel() for p in model.parameters())
    config, tp, ep = REAL[name], axes["tp"], axes.get("ep", 1)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    # Embeddings: the vocabulary split over tp.
    assert row(report, "model.embed_tokens.weight").bytes_per_rank == vocab // tp * hidden * F32
    layer = config["num_hidden_layers"] - 1
    if "num_experts" in config or "n_routed_experts" in config:
        experts = config.get("num_experts", config.get("n_routed_experts"))
        inner = config["moe_intermediate_size"]
        gate_up = row(report, f"model.layers.{layer}.mlp.experts.gate_up_proj")
        assert gate_up.placements == {"ep": "S(0)"}  # at ep > 1 the EP rules replace the TP ones
        assert gate_up.bytes_per_rank == experts // ep * 2 * inner * hidden * F32
    if name != "deepseek_v3":  # DeepSeek-V3's stock plan leaves its MLA attention whole
        heads, head_dim = config["num_attention_heads"], config.get("head_dim", hidden // config["num_attention_heads"])
        q = row(report, f"model.layers.{layer}.self_attn.q_proj.weight")
        assert q.local_shape == (heads * head_dim // tp, hidden) and q.bytes_per_rank == heads * head_dim // tp * hidden * F32
    rank = report.ranks[0]
    assert rank.parameter_bytes == sum(p.bytes_per_rank for p in report.params)
    assert rank.gradient_bytes == rank.parameter_bytes and rank.optimizer_bytes == 2 * rank.parameter_bytes
    first_two = [{"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": tp_rank, "ep": tp_rank % ep} for tp_rank in (0, 1)]
    assert len(report.ranks) == LayoutContext(axes).world.size and [r.coordinates for r in report.ranks[:2]] == first_two


def test_experts_left_unsharded_lead_the_whole_on_every_rank_list(real_models: dict[str, Any]) -> None:
    # transformers #48308: experts never sharded held 60 GB per rank; here the report says so first.
    model = real_models["deepseek_v3"]
    model.tp_plan = {key: style for key, style in model.tp_plan.items() if ".experts" not in key}
    try:
        report = plan_report(model, resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 8})))
    finally:
        model.init_parallel_plans()
    first = report.whole_on_every_rank[0]
    assert first.fqn in {f"model.layers.<3-60>.mlp.experts.{n}" for n in ("gate_up_proj", "down_proj")}
    assert first.count == 58 and first.bytes_each == 256 * 2 * 2048 * 7168 * F32
    assert "58 x model.layers.<3-60>.mlp.experts." in report.text()


def test_optimizer_state_follows_the_optimizer_and_a_bad_one_is_refused(real_models: dict[str, Any]) -> None:
    model = real_models["llama_405b"]
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 8}))
    parameters = plan_report(model, plan, optimizer="none").ranks[0].parameter_bytes
    states = {
        name: plan_report(model, plan, optimizer=name).ranks[0].optimizer_bytes for name in ("none", "sgd-momentum", "adam")
    }
    assert states == {"none": 0, "sgd-momentum": parameters, "adam": 2 * parameters}
    bf16 = hf_model("llama", dtype=torch.bfloat16)
    bf16_plan = resolve_plan(bf16, from_hf_plan(bf16), LayoutContext({"tp": 2}))
    report = plan_report(bf16.to(torch.bfloat16), bf16_plan, optimizer="adam-fp32-master")
    local = sum(math.prod(p.local_shape) for p in report.params)
    assert report.ranks[0].optimizer_bytes == 3 * local * F32  # a float32 master copy and two float32 moments
    with pytest.raises(ValueError, match="optimizer must be one of none, sgd-momentum, adam, adam-fp32-master"):
        plan_report(model, plan, optimizer="adamw")


def test_sizes_read_as_people_read_them() -> None:
    assert [size_text(n) for n in (512, 1536, 3 * 2**30 // 2)] == ["512 B", "1.50 KiB", "1.50 GiB"]


def test_check_prints_the_report_and_carries_it_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *DEMO, *DEMO_AXES, "--report"]) == 0
    out = capsys.readouterr().out
    assert "2 x blocks.<0-1>.moe.w_gate  [8, 64, 32] -> [4, 64, 32]  ep:S(0)  32.00 KiB" in out
    assert "every one of the 4 ranks holds: parameters" in out and "whole on every rank, largest first:" in out
    assert main(["check", *DEMO, *DEMO_AXES, "--report", "--json", "--optimizer", "sgd-momentum"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert set(report) >= {"rank_groups", "params", "whole_on_every_rank", "totals"}
    assert [(g["first"], g["count"]) for g in report["rank_groups"]] == [(0, 4)]
    assert report["totals"]["optimizer_bytes_per_rank"] == report["totals"]["parameter_bytes_per_rank"]
    assert report["totals"]["parameters"] == sum(math.prod(p["shape"]) for p in report["params"])


def test_the_page_loads_in_headless_chromium_and_shows_the_jsons_totals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from selenium.webdriver.common.by import By

    page = tmp_path / "report.html"
    assert main(["check", *DEMO, *DEMO_AXES, "--json", "--html", str(page)]) == 0
    totals = json.loads(capsys.readouterr().out)["report"]["totals"]
    assert "http" not in page.read_text().replace("http://www.w3.org", "")  # nothing fetched
    with opened_page(page) as driver:
        shown = {
            cell.get_attribute("data-total"): int(cell.text) for cell in driver.find_elements(By.CSS_SELECTOR, "td[data-total]")
        }
        assert shown == totals
        bars = driver.find_elements(By.CSS_SELECTOR, "#bars .bar")
        drawn = [tuple(int(bar.get_attribute(f"data-{key}")) for key in ("first", "count", "total")) for bar in bars]
        assert drawn == [(0, 4, totals["total_bytes_per_rank"])]
        assert "ranks 0\u20133 (4 ranks, each the same)" in bars[0].text
        assert driver.find_elements(By.XPATH, "//summary[contains(., 'blocks')]")
        parameter = driver.find_element(By.XPATH, "//div[@class='param' and contains(., 'w_gate')]")
        assert "ep: S(0)" in parameter.get_attribute("title") and "[4,64,32]" in parameter.get_attribute("title")


def test_the_page_shows_each_fsdp_units_dtypes_and_buffers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from selenium.webdriver.common.by import By

    page = tmp_path / "report.html"
    axes = ["--axis", "dp_shard=2", "--axis", "cp=1", "--axis", "tp=2", "--axis", "ep=2"]
    assert main(["check", *DEMO, *axes, "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--json", "--html", str(page)]) == 0
    units = json.loads(capsys.readouterr().out)["report"]["units"]
    with opened_page(page) as driver:
        rows = driver.find_elements(By.CSS_SELECTOR, "#units tr[data-fqn]")
        assert [row.get_attribute("data-fqn") for row in rows] == [unit["fqn"] for unit in units]
        assert all("float32 \u2192 bfloat16" in row.text and "float32" in row.text for row in rows)
        shown = [row.get_attribute("data-bytes") for row in rows]
        assert shown == [f"{unit['shard_bytes']},{unit['gathered_bytes']},{unit['reduce_scatter_bytes']}" for unit in units]


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's state after one step, saved by 4 ranks at cp=2, tp=2, ep=2."""
    directory = tmp_path_factory.mktemp("demo-checkpoint")
    demo.run_local(DemoConfig(save=str(directory)))
    return directory


def test_a_checkpoint_saved_at_one_layout_fits_another_and_not_more_experts(
    demo_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = ["--axis", "dp_shard=4", "--axis", "cp=1", "--axis", "tp=1", "--axis", "ep=4"]
    assert main(["check", *DEMO, *other, "--checkpoint", str(demo_checkpoint)]) == 0
    assert "fits the model" in capsys.readouterr().err
    more = ["test_report:sixteen_experts", DEMO[1]]
    assert main(["check", *more, *other, "--checkpoint", str(demo_checkpoint)]) == 1
    err = capsys.readouterr().err
    assert "does not fit the model (8 keys):" in err  # three expert weights and the router, two layers
    assert (
        "shape      2 keys 'blocks.<0-1>.moe.w_gate': the checkpoint's shape (8, 64, 32) is not the model's (16, 64, 32)" in err
    )


def test_a_safetensors_checkpoint_is_checked_from_its_headers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = hf_model("llama")
    state = {key: value.clone() for key, value in model.state_dict().items() if key != "model.layers.1.mlp.up_proj.weight"}
    state["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 64)
    state["model.layers.0.mlp.extra"] = torch.zeros(1)
    save_file({k: v for k, v in state.items() if k.startswith("model.layers.0")}, str(tmp_path / "a.safetensors"))
    save_file(
        {k: v.contiguous() for k, v in state.items() if not k.startswith("model.layers.0")}, str(tmp_path / "b.safetensors")
    )
    index = {"weight_map": {k: "a.safetensors" if k.startswith("model.layers.0") else "b.safetensors" for k in state}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, **_small("llama")}))
    assert main(["check", "--hf-config", str(config), "--axis", "tp=2", "--checkpoint", str(tmp_path), "--json"]) == 1
    misfits = {(m["kind"], m["key"]) for m in json.loads(capsys.readouterr().out)["checkpoint"]}
    assert misfits == {
        ("missing", "model.layers.1.mlp.up_proj.weight"),
        ("shape", "model.layers.0.mlp.gate_proj.weight"),
        ("unexpected", "model.layers.0.mlp.extra"),
    }


def sixteen_experts() -> nn.Module:
    """The demo's model with twice its experts: what a checkpoint of the demo does not fit."""
    return MoETransformer(TransformerConfig(experts=16))


def _small(name: str) -> dict[str, Any]:
    from hf_models import SMALL

    return SMALL[name]


def test_the_report_needs_a_resolved_plan() -> None:
    model = hf_model("llama")
    with pytest.raises(TypeError, match="plan must be a ParallelPlan"):
        plan_report(model, {})  # type: ignore[arg-type]
    with pytest.raises(PlanError):
        resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 3}))


def test_a_world_of_ten_to_the_eleven_ranks_costs_what_one_of_eight_does(capsys: pytest.CaptureFixture[str]) -> None:
    # One group of ranks alike, every rank's row made when read: no list as long as the world.
    axes = ["--axis", "dp=100000000000", "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2"]
    assert main(["check", *DEMO, *axes, "--report", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["report"]
    assert report["totals"]["world_size"] == 4 * 10**11
    assert [(g["first"], g["count"]) for g in report["rank_groups"]] == [(0, 4 * 10**11)]
    model = MoETransformer(TransformerConfig())
    plan = resolve_plan(model, [loss_head_request()], LayoutContext({"dp": 10**11, "cp": 2, "tp": 2, "ep": 2}))
    ranks = plan_report(model, plan).ranks
    assert len(ranks) == 4 * 10**11
    assert dict(ranks[-1].coordinates) == {"pp": 0, "dp_replicate": 10**11 - 1, "dp_shard": 0, "cp": 1, "tp": 1, "ep": 1}
    assert dict(ranks[6].coordinates) == {"pp": 0, "dp_replicate": 1, "dp_shard": 0, "cp": 1, "tp": 0, "ep": 0}
    assert ranks[6].parameter_bytes == ranks[0].parameter_bytes


# FSDP2 at the worlds published training runs use (SPEC §10): 256 ranks, each rank the padded
# chunk FSDP allocates of its TP- or EP-local tensor, computed here by hand from the config.
FSDP_WORLDS = {
    "deepseek_v3": {"dp_shard": 32, "tp": 8, "ep": 32},  # experts: 256 / 32 = 8 per ep rank, over edp_shard = 8
    "qwen3_moe_235b": {"dp_shard": 64, "tp": 4, "ep": 8},  # experts: 128 / 8 = 16 per ep rank, over edp_shard = 32
    "llama_405b": {"dp_shard": 32, "tp": 8},
}
FSDP_UNITS = FullyShard(("model.layers.*.mlp.experts", "model.layers.*"))
DENSE_UNITS = FullyShard(("model.layers.*",))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("name", list(FSDP_WORLDS))
def test_fsdp_bytes_per_rank_at_real_sizes_by_hand(real_models: dict[str, Any], name: str) -> None:
    model, axes, config = real_models[name], FSDP_WORLDS[name], REAL[name]
    units = FSDP_UNITS if "ep" in axes else DENSE_UNITS
    report = plan_report(model, resolve_plan(model, from_hf_plan(model), LayoutContext(axes), fully_shard=units))
    world = LayoutContext(axes).world
    tp, ep, hidden = axes["tp"], axes.get("ep", 1), config["hidden_size"]
    assert world.size == 256 and [(g.first, g.count) for g in report.rank_groups] == [(0, 256)]
    assert "every one of the 256 ranks holds" in report.text()
    # The embedding: vocab / tp rows, then a padded chunk of them over dp_shard.
    embed = row(report, "model.embed_tokens.weight")
    assert embed.bytes_per_rank == ceil_div(config["vocab_size"] // tp, axes["dp_shard"]) * hidden * F32
    norm = row(report, "model.norm.weight")
    assert norm.local_shape == (ceil_div(hidden, axes["dp_shard"]),)
    if ep > 1:
        experts = config.get("num_experts", config.get("n_routed_experts"))
        edp_shard = axes["dp_shard"] * tp // ep
        gate_up = row(report, f"model.layers.{config['num_hidden_layers'] - 1}.mlp.experts.gate_up_proj")
        local_experts = ceil_div(experts // ep, edp_shard)
        assert (gate_up.fsdp_shards, gate_up.local_shape) == (
            edp_shard,
            (local_experts, 2 * config["moe_intermediate_size"], hidden),
        )
    else:
        q = row(report, "model.layers.0.self_attn.q_proj.weight")  # heads split over tp, then over dp_shard
        assert q.local_shape == (ceil_div(hidden // tp, axes["dp_shard"]), hidden)
    rank = report.ranks[255]
    assert rank.parameter_bytes == sum(p.bytes_per_rank for p in report.params) == rank.gradient_bytes


def test_fsdp_divides_the_replicated_state_by_the_data_parallel_ranks(real_models: dict[str, Any]) -> None:
    # DeepSeek-V3 at dp=8, tp=8, ep=8: replicas of the TP/EP shard on every data-parallel rank,
    # until FSDP shards them over those 8 ranks (padding keeps it a little above an eighth).
    model = real_models["deepseek_v3"]
    replicas = LayoutContext({"dp_replicate": 8, "tp": 8, "ep": 8})
    replicated = plan_report(model, resolve_plan(model, from_hf_plan(model), replicas))
    sharded = plan_report(
        model, resolve_plan(model, from_hf_plan(model), LayoutContext({"dp_shard": 8, "tp": 8, "ep": 8}), fully_shard=FSDP_UNITS)
    )
    whole, part = replicated.ranks[0].total_bytes, sharded.ranks[0].total_bytes
    assert whole / 8 <= part <= whole / 8 * 1.001
    # dp_shard alone shards too, over torchtitan's default units (each layer, the experts, the root).
    defaulted = plan_report(model, resolve_plan(model, from_hf_plan(model), LayoutContext({"dp_shard": 8, "tp": 8, "ep": 8})))
    assert whole / 8 <= defaulted.ranks[0].total_bytes <= whole / 8 * 1.001
