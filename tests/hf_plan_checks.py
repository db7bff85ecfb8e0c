"""Checked Hugging Face plans applied by transformers' own apply functions on a 2-rank gloo world
(run on every rank by test_hf_plans.py): the logits equal one process's."""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from meshbind import MeshContext, plan_report, resolve_plan
from meshbind.examples.parallel_parts import local
from meshbind.interop.hf_plans import apply_hf_plan, from_hf_plan

from hf_models import hf_model
from rank_checks import Results, attempt_each


def check_forward_equals_one_process(name: str, tp: int, ep: int) -> None:
    # The second rank of a tp=1 world runs another sequence chunk (cp): experts borrow it for ep, and
    # no FSDP shards what the plan leaves whole, as dp_shard would.
    context = MeshContext.build(cp=2 // tp, tp=tp, ep=ep)
    model = hf_model(name)
    reference = copy.deepcopy(model)
    plan = resolve_plan(model, from_hf_plan(model), context.layout_context())
    predicted = plan_report(model, plan, optimizer="none")
    ep_mesh = context.fsdp_moe_mesh["ep"] if context.fsdp_moe_mesh is not None and ep > 1 else None
    apply_hf_plan(model, plan, tp_mesh=context.device_mesh["tp"], ep_mesh=ep_mesh)
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if not sharded:
        raise AssertionError("transformers sharded no parameter")
    held = sum(local(p).numel() * p.element_size() for p in model.parameters())
    if held != predicted.ranks[torch.distributed.get_rank()].parameter_bytes:
        raise AssertionError(f"plan_report said {predicted.ranks[0].parameter_bytes} bytes per rank, the rank holds {held}")
    if predicted.parameter_count != sum(p.numel() for p in reference.parameters()):
        raise AssertionError("plan_report's parameter count is not the model's")
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    got = got.full_tensor() if isinstance(got, DTensor) else got
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"logits differ from one process by {float((got - expected).abs().max())}")


def check_each(checks: list[str]) -> Results:
    """``"qwen3_moe tp2 ep2"``: the model class, then its axes (a missing one is 1)."""

    def run(check: str) -> None:
        name, *axes = check.split()
        sizes = {axis[:2]: int(axis[2:]) for axis in axes}
        check_forward_equals_one_process(name, sizes.get("tp", 1), sizes.get("ep", 1))

    return attempt_each({check: (lambda check=check: run(check)) for check in checks})
