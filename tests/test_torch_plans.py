"""torch parallelize_module plans (SPEC §9): keys resolved with torch's semantics by meshbind's
engine, every problem at once, and a checked plan applied by torch itself."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from resolution_methods import RecordingStyle
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshbind import LayoutContext, PatternSet, PlanError, resolve_plan
from meshbind.interop.torch_plans import from_torch_plan, style_placements, torch_key_pattern
from meshbind.launch import run_local_world

from hf_models import hf_model
from torchtitan_plans import deepseek_v3_plan, llama3_plan, torchtitan_model


def transformer() -> nn.Module:
    model = nn.Module()
    model.embed = nn.Embedding(12, 16)
    model.layers = nn.ModuleList()
    for _ in range(11):
        block = nn.Module()
        block.attn = nn.ModuleDict({name: nn.Linear(16, 16) for name in ("q", "k", "v", "o")})
        block.mlp = nn.ModuleDict({"up": nn.Linear(16, 32), "down": nn.Linear(32, 16)})
        model.layers.append(block)
    model.head = nn.Linear(16, 12)
    return model


MODEL = transformer()
FQN = {id(module): name for name, module in MODEL.named_modules()}
NAMES = ["layers", "attn", "mlp", "q", "k", "v", "o", "up", "down", "embed", "head", "1", "10"]
GLOBS = ["*", "?", "1?", "[0-2]", "[!1]", "*o*", "u*", "[]x]", "la*s", "a{b}", "1[0-9]"]
SEGMENT = st.sampled_from(NAMES + GLOBS)
KEY = st.lists(SEGMENT, min_size=1, max_size=4).map(".".join)


def torch_selects(model: nn.Module, keys: list[str]) -> set[str]:
    seen: list[nn.Module] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch only warns about a key that selects nothing
        parallelize_module(model, object(), dict.fromkeys(keys, RecordingStyle(seen)))  # type: ignore[arg-type]
    fqns = FQN if model is MODEL else {id(module): name for name, module in model.named_modules()}
    return {fqns[id(module)] for module in seen}


def meshbind_selects(model: nn.Module, keys: list[str]) -> set[str]:
    tree = PatternSet([torch_key_pattern(key) for key in keys]).walk(model)
    return {fqn for fqn, _ in tree.matches()}


@settings(max_examples=300, deadline=None)
@given(st.lists(KEY, min_size=1, max_size=4, unique=True))
def test_meshbind_selects_exactly_what_torch_selects(keys: list[str]) -> None:
    assert meshbind_selects(MODEL, keys) == torch_selects(MODEL, keys)


def test_braces_and_ranges_are_literal_in_torch_keys() -> None:
    assert torch_key_pattern("layers.{0,1}.attn") == "layers.\\{0\\,1\\}.attn"
    assert torch_key_pattern("layers.<0-3>") == "layers.\\<0-3\\>"
    assert torch_key_pattern("layers.**.q") == "layers.*.q"  # ** is * inside one fnmatch part


def test_every_problem_of_a_torch_plan_comes_back_at_once() -> None:
    plan = {
        "layers.*.attn.q": ColwiseParallel(),
        "layers.0.attn.q": RowwiseParallel(),  # a second style for one module
        "layers.*.mlp.upp": ColwiseParallel(),  # a typo
        "layers.*.mlp.down": RowwiseParallel(),
    }
    with pytest.raises(PlanError) as caught:
        resolve_plan(MODEL, from_torch_plan(plan), LayoutContext({"tp": 3}))
    problems = caught.value.problems
    codes = {(p.code, p.fqn) for p in problems}
    assert ("conflict", "layers.0.attn.q") in codes
    [unmatched] = [p for p in problems if p.code == "unmatched"]
    assert "pattern 'layers.*.mlp.upp' does not select any module; did you mean" in unmatched.message
    # tp=3 divides neither the 16 output rows of q nor the 32 input columns of down.
    layout = [p for p in problems if p.code == "layout"]
    q_rows = "params['weight'] dimension 0 of size 16 is not divisible by 3"
    assert any(p.fqn == "layers.1.attn.q" and q_rows in p.message for p in layout)
    assert any(p.fqn == "layers.0.mlp.down" and "params['weight'] dimension 1 of size 32" in p.message for p in layout)
    assert "('tp'=3)" in layout[0].message


def test_a_checked_plan_keeps_one_style_per_module() -> None:
    requests = from_torch_plan({"layers.*.mlp.up": ColwiseParallel(), "head": RowwiseParallel()})
    plan = resolve_plan(MODEL, requests, LayoutContext({"tp": 2}))
    assert len(plan.parallel_modules) == 12
    assert plan.sharding["head"].params == {"weight": {"tp": Shard(1)}, "bias": {"tp": Replicate()}}
    assert style_placements(ColwiseParallel(), nn.Embedding(4, 2)) == {"weight": Shard(1)}


def test_torch_applies_the_checked_plan_on_a_gloo_world() -> None:
    assert run_local_world(2, "torch_plan_checks:check_forward_equals_one_process") == [None, None]


TORCHTITAN = {
    "llama3 405B": ("llama3", "405B", llama3_plan(), 8),
    "deepseek_v3 671B": ("deepseek_v3", "671B", deepseek_v3_plan(q_lora=True), 8),
    "deepseek_v3 debugmodel": ("deepseek_v3", "debugmodel", deepseek_v3_plan(q_lora=False), 4),
}


@pytest.mark.parametrize("case", list(TORCHTITAN))
def test_torchtitans_own_plans_resolve_and_select_what_torch_selects(case: str) -> None:
    name, flavor, plan, tp = TORCHTITAN[case]
    model = torchtitan_model(name, flavor)
    resolved = resolve_plan(model, from_torch_plan(plan), LayoutContext({"tp": tp}))
    assert set(resolved.parallel_modules) == torch_selects(model, list(plan)) == meshbind_selects(model, list(plan))
    assert not resolved.warnings


def test_digits_inside_torchtitan_names_are_literal() -> None:
    # transformers PR #42129 rewrote the digits of w1/w2/w3 and skipped experts; fnmatch keeps them.
    model = torchtitan_model("llama3", "debugmodel")
    selected = meshbind_selects(model, ["layers.*.feed_forward.w1"])
    assert selected == {f"layers.{i}.feed_forward.w1" for i in range(6)}


def test_mistakes_in_a_torchtitan_plan_come_back_at_once() -> None:
    model = torchtitan_model("llama3", "debugmodel")
    plan = llama3_plan()
    plan["layers.*.atention.wo"] = plan.pop("layers.*.attention.wo")
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, from_torch_plan(plan), LayoutContext({"tp": 3}))
    problems = caught.value.problems
    [unmatched] = [p for p in problems if p.code == "unmatched"]
    assert "'layers.*.atention.wo' does not select any module; did you mean 'layers.0.attention.wo'" in unmatched.message
    # tp=3 divides the 768 rows of the feed-forward and of the fused qkv, not the vocabulary of 2048.
    uneven = {p.fqn for p in problems if p.code == "layout" and "dimension 0 of size 2048 is not divisible by 3" in p.message}
    assert uneven == {"lm_head", "tok_embeddings"} and len(problems) == 3


@pytest.mark.parametrize("name", ["llama3", "deepseek_v3"])
def test_torch_applies_a_checked_torchtitan_plan_on_a_gloo_world(name: str) -> None:
    assert run_local_world(2, "torch_plan_checks:check_torchtitan_forward_equals_one_process", name) == [None, None]


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_on_transformers_skeletons_meshbind_selects_what_torch_selects(name: str) -> None:
    model = hf_model(name, layers=3)
    names = sorted({part for fqn, _ in model.named_modules() for part in fqn.split(".") if part})
    keys = [*model.tp_plan, *model.ep_plan, "model.layers.*", "*.*.?.self_attn", "model.layers.[!0].mlp.*"]
    keys += [f"model.layers.*.{part}" for part in names[:: max(len(names) // 8, 1)]]
    assert meshbind_selects(model, keys) == torch_selects(model, keys)
