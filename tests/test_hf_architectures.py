"""Every architecture the installed transformers ships a plan for (SPEC §9): each model type whose
config declares a ``base_model_tp_plan`` or ``base_model_ep_plan``, built on ``meta`` from its config
class's defaults shrunk (tests/hf_models.py), expands exactly as transformers' own
``_resolve_parallel_plans`` at tp=2, at ep=2 where it has experts, and at both; every name the
expansion gives exists (tied parameters included), and the report counts the model's parameters.
A type that cannot be built so is skipped with transformers' reason, one line each."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import transformers
from transformers.distributed.configuration_utils import DistributedConfig

from meshbind import LayoutContext, plan_report, resolve_plan
from meshbind.interop.hf_plans import expanded_plans, from_hf_plan

from hf_models import planned_model_types, tiny_model

MODEL_TYPES = planned_model_types()


@functools.cache
def built(model_type: str) -> Any:
    """The tiny model, or the reason it cannot be built (a string)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # defaults rewritten by the config class are not news here
    try:
        return tiny_model(model_type)
    except Exception as error:
        return f"{type(error).__name__}: {' '.join(str(error).split())[:240]}"
    finally:
        transformers.logging.set_verbosity(verbosity)


def layouts_of(model: Any) -> list[dict[str, int]]:
    """tp=2 where the model has a tp plan; ep=2 (over dp=2) and tp=2 with ep=2 where it has experts."""
    layouts = [{"tp": 2}] if model.tp_plan else []
    if model.ep_plan:
        layouts += [{"dp_shard": 2, "ep": 2}] + ([{"tp": 2, "ep": 2}] if model.tp_plan else [])
    return layouts


def transformers_plans(model: Any, axes: dict[str, int]) -> dict[str, dict[str, str]]:
    tp, ep = axes.get("tp", 1), axes.get("ep", 1)
    tp_plan, ep_plan, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp, ep_size=ep, fsdp_size=max(ep // tp, 1)))
    return {"tp": tp_plan, "ep": ep_plan}


def test_the_installed_transformers_ships_plans_for_many_architectures() -> None:
    built_ones = [name for name in MODEL_TYPES if not isinstance(built(name), str)]
    assert len(MODEL_TYPES) >= 100 and len(built_ones) >= 0.75 * len(MODEL_TYPES), (len(MODEL_TYPES), len(built_ones))
    assert {"llama", "qwen3", "phi3", "olmoe", "qwen2_moe", "gemma3_text", "gpt_oss", "deepseek_v2"} <= set(built_ones)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_each_architecture_expands_as_transformers_does_and_is_counted_whole(model_type: str) -> None:
    model = built(model_type)
    if isinstance(model, str):
        pytest.skip(f"{model_type} cannot be built from its config's defaults: {model}")
    every_name = {name for name, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_modules()}
    parameters = sum(p.numel() for p in model.parameters())
    for axes in layouts_of(model):
        plan = resolve_plan(model, from_hf_plan(model), LayoutContext(axes))
        ours = expanded_plans(model, plan)
        want = transformers_plans(model, axes)
        assert {kind: list(rules.items()) for kind, rules in ours.items()} == {
            kind: list(rules.items()) for kind, rules in want.items()
        }, axes
        assert not [name for rules in ours.values() for name in rules if name not in every_name], axes
        assert plan_report(model, plan, optimizer="none").parameter_count == parameters, axes
