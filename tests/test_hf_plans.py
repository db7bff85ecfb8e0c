"""Hugging Face plans (SPEC §9) on transformers skeletons built from configs in tests/hf_models.py:
expanded exactly as transformers expands them, config facts checked against the axes, every problem
at once, and a checked plan applied by transformers' own code on a gloo world."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Shard
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.distributed.configuration_utils import DistributedConfig

from meshbind import LayoutContext, PatternSet, PlanError, plan_report, resolve_plan
from meshbind.interop.hf_plans import expanded_plans, from_hf_plan, hf_key_pattern
from meshbind.launch import run_local_world
from meshbind.model_index import ModelIndex

from hf_models import SMALL, THREE_KV_HEADS, hf_model
from rank_checks import failures_of

AXES = {"tp2": {"tp": 2}, "ep2": {"dp_shard": 2, "ep": 2}, "tp2-ep2": {"tp": 2, "ep": 2}, "tp4-ep4": {"tp": 4, "ep": 4}}


def transformers_plans(model: Any, axes: dict[str, int]) -> dict[str, list[tuple[str, str]]]:
    tp, ep = axes.get("tp", 1), axes.get("ep", 1)
    tp_plan, ep_plan, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp, ep_size=ep, fsdp_size=max(ep // tp, 1)))
    return {"tp": list(tp_plan.items()), "ep": list(ep_plan.items())}


@pytest.fixture(scope="module")
def small_models() -> dict[str, Any]:
    return {name: hf_model(name, layers=3) for name in SMALL}


EXPANSIONS = [(name, axes) for name in SMALL for axes in AXES if name != "llama" or "ep" not in AXES[axes]]
"""Every small model on every layout its plans cover (Llama has no ep_plan)."""


@pytest.mark.parametrize(("name", "axes"), EXPANSIONS)
def test_plans_expand_exactly_as_transformers_expands_them(small_models: dict[str, Any], name: str, axes: str) -> None:
    model = small_models[name]
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext(AXES[axes]))
    ours = {kind: list(exact.items()) for kind, exact in expanded_plans(model, plan).items()}
    assert ours == transformers_plans(model, AXES[axes])
    assert ours["tp"] or ours["ep"]


def test_an_experts_module_gets_its_own_style_and_its_parameters_styles_in_one_entry(small_models: dict[str, Any]) -> None:
    model = small_models["qwen3_moe"]
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
    experts = plan.sharding["model.layers.1.mlp.experts"].params
    assert {name: str(p["tp"]) for name, p in experts.items()} == {"gate_up_proj": "_S(1, 2)", "down_proj": "S(2)"}
    assert plan.parallel_modules["model.layers.1.mlp.experts"].options["rules"]["tp"].module == "moe_tp_experts"


def test_ep_rules_take_precedence_and_replace_the_tp_rules_of_expert_modules(small_models: dict[str, Any]) -> None:
    model = small_models["qwen3_moe"]
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2, "ep": 2}))
    experts = plan.sharding["model.layers.0.mlp.experts"].params
    assert {name: dict(p) for name, p in experts.items()} == {
        name: {"ep": plan.sharding["model.layers.0.mlp.experts"].params[name]["ep"]} for name in ("gate_up_proj", "down_proj")
    }
    assert str(experts["gate_up_proj"]["ep"]) == "S(0)"
    assert str(plan.sharding["model.layers.0.self_attn.q_proj"].params["weight"]["tp"]) == "S(0)"


def test_the_stock_plans_of_real_sizes_resolve_with_their_known_warnings() -> None:
    # Qwen3-MoE's plan keeps rules for dense MLPs, which a model with every layer sparse lacks.
    expected = {
        ("llama", (("tp", 8),)): set(),
        ("mixtral", (("tp", 8), ("ep", 8))): set(),
        ("qwen3_moe", (("dp_shard", 2), ("tp", 4), ("ep", 8))): {f"model.layers.*.mlp.{n}_proj" for n in ("gate", "up", "down")},
        ("deepseek_v3", (("tp", 8), ("ep", 8))): set(),
    }
    for (name, axes), warned in expected.items():
        model = hf_model(name, real=True)
        plan = resolve_plan(model, from_hf_plan(model), LayoutContext(dict(axes)))
        assert {w.request.partition("[")[2][1:-2] for w in plan.warnings} == warned, name
        assert all(w.code == "unmatched" for w in plan.warnings)
        assert len(plan.parallel_modules) > 100


def test_tp_not_dividing_the_key_value_heads_is_caught_before_anything_loads() -> None:
    # transformers #48307: tp=8 on a model with 4 key/value heads failed in attention at the first forward.
    model = hf_model("qwen3_moe", real=True)
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 8}))
    text = str(caught.value)
    because = "num_key_value_heads 4 is not divisible by the 'tp' axis size 8"
    for projection in ("k_proj", "v_proj"):
        assert f"48 modules 'model.layers.<0-47>.self_attn.{projection}': {because}" in text
    assert "q_proj" not in text  # 32 attention heads divide
    assert len(caught.value.problems) == 96


def test_ep_not_dividing_the_experts_is_caught_up_front() -> None:
    # torchtitan #4258: a bad EP degree failed late, inside DeviceMesh.
    model = hf_model("deepseek_v3", real=True)
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, from_hf_plan(model), LayoutContext({"dp_shard": 3, "ep": 3}))
    assert "58 modules 'model.layers.<3-60>.mlp.experts': n_routed_experts 256 is not divisible by the 'ep' axis size 3" in str(
        caught.value
    )
    assert {p.fqn for p in caught.value.problems} == {f"model.layers.{i}.mlp.experts" for i in range(3, 61)}


def test_tp_not_dividing_the_hidden_size_names_every_config_fact_at_once() -> None:
    # tp=3 on a 4096-wide model passed every check of transformers and torch.
    model = hf_model("mixtral", real=True)
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 3}))
    text = str(caught.value)
    assert (
        "32 modules 'model.layers.<0-31>.self_attn.q_proj': num_attention_heads 32 is not divisible by the 'tp' axis size 3"
        in text
    )
    assert "num_key_value_heads 8 is not divisible by the 'tp' axis size 3" in text
    assert "'model.embed_tokens': vocab_size 32000 is not divisible by the 'tp' axis size 3: pad the vocabulary" in text
    assert "intermediate_size 14336 is not divisible by the 'tp' axis size 3" in text


def test_an_odd_vocabulary_is_told_to_be_padded() -> None:
    model = hf_model("llama", vocab_size=129)
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
    assert {p.fqn for p in caught.value.problems} == {"model.embed_tokens", "lm_head"}
    assert all("make-vocab-size-divisible-by" in p.message for p in caught.value.problems)


def test_a_misspelled_key_is_a_warning_with_a_suggestion_and_an_error_under_strict() -> None:
    # transformers #37893, #39944: unused rules were warnings printed after sharding.
    model = hf_model("llama")
    model.tp_plan = {**model.tp_plan, "model.layers.*.self_attn.q_prj": "colwise"}
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
    (warning,) = plan.warnings
    assert "key 'model.layers.*.self_attn.q_prj' (colwise) selects no module or parameter" in warning.message
    assert "did you mean 'model.layers.*.self_attn.q_proj'" in warning.message  # the plan's own key form
    assert "warning: unmatched" in plan.explain()
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, from_hf_plan(model, strict=True), LayoutContext({"tp": 2}))
    assert [p.request for p in caught.value.problems] == ["tp_plan['model.layers.*.self_attn.q_prj']"]


def test_a_key_with_a_concrete_layer_index_selects_nothing_as_in_transformers_and_says_why() -> None:
    model = hf_model("qwen3_moe")
    model.ep_plan = {**model.ep_plan, "model.layers.1.mlp.experts": "ep_dispatch_experts"}
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"dp_shard": 2, "ep": 2}))
    (warning,) = [w for w in plan.warnings if "layers.1" in w.message]
    assert "transformers writes layer indices as '*': 'model.layers.*.mlp.experts'" in warning.message


def test_digits_inside_a_name_are_never_a_layer_index() -> None:
    # transformers PR #42129: digits in w1/w2/w3 were rewritten to '*', so Mixtral's experts were skipped.
    names = ["layers.0.mlp.w1", "layers.12.mlp.w1", "layers.0.mlp.w2", "layers.x.mlp.w1", "layers.01.mlp.w1"]
    matched = PatternSet([hf_key_pattern("layers.*.mlp.w1")]).match_many(names)
    assert [bool(hit) for hit in matched] == [True, True, False, False, False]
    assert not PatternSet([hf_key_pattern("layers.*.mlp.w*")]).match("layers.0.mlp.w1")


def test_a_style_transformers_does_not_know_is_an_error_naming_the_key() -> None:
    model = hf_model("llama")
    model._tp_plan = {**model.tp_plan, "model.layers.*.mlp.up_proj": "colwize"}
    with pytest.raises(ValueError, match=r"tp_plan\['model.layers.\*.mlp.up_proj'\]: 'colwize'"):
        from_hf_plan(model)


def test_an_axis_without_its_plan_is_a_problem() -> None:
    model = hf_model("llama")
    with pytest.raises(PlanError, match=r"layout    \(axes\): the 'ep' axis has size 2, but LlamaForCausalLM has no ep_plan"):
        resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2, "ep": 2}))


def test_the_plan_source_refuses_another_model() -> None:
    with pytest.raises(ValueError, match="another model"):
        resolve_plan(hf_model("llama"), from_hf_plan(hf_model("llama")), LayoutContext({"tp": 2}))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        from_hf_plan(object())  # type: ignore[arg-type]


def test_tied_embeddings_are_expanded_under_both_names_and_counted_once() -> None:
    # Qwen3 tied (as Qwen3-0.6B, Llama-3.2-1B and Gemma 3 ship): the plan names lm_head.weight, a tied copy.
    model = hf_model("qwen3_tied")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
    exact = expanded_plans(model, plan)["tp"]
    assert exact["lm_head.weight"] == "colwise_gather_output" and exact["model.embed_tokens.weight"] == "embedding_rowwise"
    assert dict(ModelIndex.of(model).ties) == {"lm_head.weight": "model.embed_tokens.weight"}
    report = plan_report(model, plan, optimizer="none")
    assert report.parameter_count == sum(p.numel() for p in model.parameters())  # one tensor, not two
    assert "lm_head.weight" not in {row.fqn for row in report.params}
    assert row_of(report, "model.embed_tokens.weight").local_shape == (64, 64)  # the vocabulary split over tp


def row_of(report: Any, fqn: str) -> Any:
    return next(row for row in report.params if row.fqn == fqn)


def test_a_tie_whose_sides_are_placed_differently_is_refused() -> None:
    model = hf_model("qwen3_tied")
    model.tp_plan = {**model.tp_plan, "model.embed_tokens": "embedding_colwise"}  # Shard(1) against lm_head's Shard(0)
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
    (problem,) = caught.value.problems
    assert (problem.code, problem.fqn, problem.request) == ("layout", "lm_head", "tp_plan")
    assert problem.message.startswith(
        "'lm_head.weight' is the parameter 'model.embed_tokens.weight' (tied), given two layouts: tp:S(0) against tp:S(1)"
    )


def test_heads_are_checked_only_where_the_style_splits_them() -> None:
    # Phi-3 and OLMoE gather q/k/v outputs (colwise_gather_output): every rank keeps every head.
    for name in ("phi3_kv3", "olmoe_kv3"):
        model = hf_model(name)
        plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
        assert (
            str(
                plan.sharding["model.layers.0.self_attn." + ("qkv_proj" if name == "phi3_kv3" else "k_proj")].params["weight"][
                    "tp"
                ]
            )
            == "S(0)"
        )
    # Real Phi-3-medium: 40 heads, 10 key/value heads, 7680 qkv rows split evenly at tp=4.
    medium = dict(
        num_hidden_layers=40, hidden_size=5120, intermediate_size=17920, num_attention_heads=40, num_key_value_heads=10,
        vocab_size=32064, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config = AutoConfig.for_model("phi3", **medium)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 4}))
    assert plan.sharding["model.layers.39.self_attn.qkv_proj"].params["weight"]["tp"] == Shard(0)
    # A plain column split of 3 key/value heads over 2 ranks fails transformers' own reshape: still refused.
    model = hf_model("qwen3_tied", **THREE_KV_HEADS)
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
    assert {(p.fqn, p.message) for p in caught.value.problems} == {
        (f"model.layers.{i}.self_attn.{proj}", "num_key_value_heads 3 is not divisible by the 'tp' axis size 2")
        for i in range(2) for proj in ("k_proj", "v_proj")
    }  # fmt: skip


def test_an_expert_world_the_axes_cannot_make_is_refused_before_any_report() -> None:
    # tp=2, ep=4: two ranks would each hold one of four experts' shares, and half would live nowhere.
    with pytest.raises(ValueError, match=r"ep=4 does not divide dp_shard \* cp \* tp = 1 \* 1 \* 2 = 2.*use ep = 1, 2,"):
        LayoutContext({"tp": 2, "ep": 4})
    model = hf_model("qwen3_moe")
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2, "ep": 2}))
    assert {rank.coordinates["ep"] for rank in plan_report(model, plan).ranks} == {0, 1}


def test_a_size_is_named_after_the_field_its_parameter_is_not_an_equal_value() -> None:
    # intermediate_size == vocab_size: the MLP is told about its intermediate size, the embeddings about the vocabulary.
    model = hf_model("llama", intermediate_size=129, vocab_size=129)
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
    by_fqn = {p.fqn: p.message for p in caught.value.problems}
    for projection in ("gate_proj", "up_proj", "down_proj"):
        message = by_fqn[f"model.layers.0.mlp.{projection}"]
        assert message == "intermediate_size 129 is not divisible by the 'tp' axis size 2", message
    for embedding in ("model.embed_tokens", "lm_head"):
        assert by_fqn[embedding].startswith("vocab_size 129 is not divisible by the 'tp' axis size 2: pad the vocabulary")


def test_a_key_for_a_module_the_model_lacks_is_offered_the_same_leaf_in_the_plans_form() -> None:
    # Qwen2-MoE's stock plan keeps dense MLP rules; every layer is sparse, with a shared expert.
    model = hf_model("qwen2_moe")
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
    (gate,) = [w for w in plan.warnings if "'model.layers.*.mlp.gate_proj'" in w.message]
    assert gate.line().startswith("unmatched (key): key 'model.layers.*.mlp.gate_proj' (colwise) selects no module")
    assert "did you mean 'model.layers.*.mlp.shared_expert.gate_proj'" in gate.message


CHECKS = [
    "llama tp2", "qwen3_moe tp2", "qwen3_moe ep2", "mixtral tp2 ep2", "deepseek_v3 tp2",
    "qwen3_tied tp2", "gemma3_text tp2", "phi3_kv3 tp2", "olmoe_kv3 tp2", "olmoe ep2", "qwen2_moe tp2", "qwen2_moe ep2",
    "mistral tp2", "granitemoe tp2", "gpt_oss ep2", "deepseek_v2 tp2", "glm4_moe tp2 ep2",
]  # fmt: skip
"""The stock plans of fifteen architectures applied by transformers on 2 ranks, logits compared with one
process and each rank's bytes with the report: tied embeddings, gathered outputs over 3 key/value heads,
shared experts, packed and biased experts, MLA attention."""


@pytest.fixture(scope="module")
def world_results() -> list[dict[str, str | None]]:
    results: list[dict[str, str | None]] = run_local_world(2, "hf_plan_checks:check_each", CHECKS)
    return results


@pytest.mark.parametrize("check", CHECKS)
def test_transformers_applies_the_checked_plan_and_the_forward_equals_one_process(
    world_results: list[dict[str, str | None]], check: str
) -> None:
    assert not failures_of(world_results, check)


MISTAKES = {
    # model: (a tp that splits a key/value head, or, with no attention rules, one that divides no size)
    "llama": ({"tp": 16}, "num_key_value_heads 8 is not divisible by the 'tp' axis size 16"),
    "mixtral": ({"tp": 16}, "num_key_value_heads 8 is not divisible by the 'tp' axis size 16"),
    "qwen3_moe": ({"tp": 8}, "num_key_value_heads 4 is not divisible by the 'tp' axis size 8"),
    "deepseek_v3": ({"tp": 3}, "vocab_size 129280 is not divisible by the 'tp' axis size 3"),
}
EXPERTS = {"mixtral": "num_local_experts 8", "qwen3_moe": "num_local_experts 128", "deepseek_v3": "n_routed_experts 256"}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_deliberate_mistakes_on_each_real_skeleton_are_caught(name: str) -> None:
    model = hf_model(name, real=True)
    # A misspelled key: a warning with the key it meant.
    key = next(k for k in model.tp_plan if "layers" in k and k.endswith("proj"))
    model.tp_plan = {(k.replace("proj", "prj") if k == key else k): style for k, style in model.tp_plan.items()}
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext({"tp": 2}))
    [typo] = [w for w in plan.warnings if "prj" in w.message]
    assert f"did you mean {key!r}" in typo.message, typo.message
    model.init_parallel_plans()
    axes, because = MISTAKES[name]
    with pytest.raises(PlanError, match=re.escape(because)):
        resolve_plan(model, from_hf_plan(model), LayoutContext(axes))
    if name in EXPERTS:
        with pytest.raises(PlanError, match=re.escape(f"{EXPERTS[name]} is not divisible by the 'ep' axis size 3")):
            resolve_plan(model, from_hf_plan(model), LayoutContext({"dp_shard": 3, "ep": 3}))
