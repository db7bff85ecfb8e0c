"""A checked torch plan applied by torch's own parallelize_module on a 2-rank gloo world (run on
every rank by test_torch_plans.py): the forward pass equals one process."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from meshbind import MeshContext, resolve_plan
from meshbind.interop.torch_plans import from_torch_plan, parallelize_checked

from torchtitan_plans import torchtitan_model


def mlp_model() -> nn.Module:
    torch.manual_seed(7)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)}) for _ in range(2))
    return model


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in model.layers:  # type: ignore[union-attr]
        x = layer["down"](torch.relu(layer["up"](x)))
    return x


def check_forward_equals_one_process() -> str | None:
    context = MeshContext.build(tp=torch.distributed.get_world_size())
    model = mlp_model()
    reference = copy.deepcopy(model)
    requests = from_torch_plan({"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})
    plan = resolve_plan(model, requests, context.layout_context())
    parallelize_checked(model, plan, context.device_mesh["tp"])
    up = model.layers[0]["up"].weight  # type: ignore[index]
    if not isinstance(up, DTensor) or tuple(up.to_local().shape) != (16 // context.axis_sizes()["tp"], 8):
        return f"the up projection was not sharded by torch: {type(up).__name__}"
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    got, expected = forward(model, x), forward(reference, x)
    got = got.full_tensor() if isinstance(got, DTensor) else got
    if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
        return f"forward differs from one process by {float((got - expected).abs().max())}"
    return None


FORWARD_PLANS: dict[str, dict[str, ParallelStyle]] = {
    "llama3": {
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    },
    "deepseek_v3": {
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "layers.*.moe.shared_experts.w1": ColwiseParallel(),
        "layers.*.moe.shared_experts.w3": ColwiseParallel(),
        "layers.*.moe.shared_experts.w2": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    },
}
"""Plans whose forward needs no sequence-parallel inputs: the feed-forwards and the output sharded."""


def check_torchtitan_forward_equals_one_process(name: str) -> str | None:
    """torchtitan's ``name`` debug model (two blocks: a dense one and, for deepseek_v3, an MoE one),
    sharded by torch with a checked plan: its logits equal one process's."""
    context = MeshContext.build(tp=torch.distributed.get_world_size())
    model = torchtitan_model(name, "debugmodel", meta=False, layers=2)
    reference = copy.deepcopy(model)
    resolved = resolve_plan(model, from_torch_plan(FORWARD_PLANS[name]), context.layout_context())
    parallelize_checked(model, resolved, context.device_mesh["tp"])
    tokens = torch.randint(0, 2048, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).repeat(2, 1)
    with torch.no_grad():  # flex attention has no backward on the CPU
        masks = model.get_attention_masks(positions)  # type: ignore[operator]
        got, expected = model(tokens, positions, masks), reference(tokens, positions, masks)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
        return f"logits differ from one process by {float((got - expected).abs().max())}"
    return None
