"""A checked torch plan applied by torch's own parallelize_module on a 2-rank gloo world (run on
every rank by test_torch_plans.py): the forward pass equals one process."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshbind import MeshContext, resolve_plan
from meshbind.interop.torch_plans import from_torch_plan, parallelize_checked


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
