"""torchtitan's llama3 and deepseek_v3 model classes, and the torch plans torchtitan's own
parallelize code writes for them (its ``apply_tp``: one dict per block, written here over the
whole model with ``layers.*``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torchtitan.distributed.tensor_parallel import NoParallel
from torchtitan.models import deepseek_v3, llama3

REGISTRIES: dict[str, Any] = {"llama3": llama3, "deepseek_v3": deepseek_v3}


def torchtitan_model(name: str, flavor: str, *, meta: bool = True, layers: int | None = None) -> nn.Module:
    """``name``'s model of ``flavor`` (``debugmodel``, ``405B``, ``671B``...) from its registry,
    its first ``layers`` blocks only when given; on ``meta``, or on the CPU with torchtitan's own
    seeded initialisation."""
    config = REGISTRIES[name].model_registry(flavor).model
    if layers is not None:
        config.layers = config.layers[:layers]
    if meta:
        with torch.device("meta"):
            model: nn.Module = config.build()
        return model
    torch.manual_seed(0)
    model = config.build()
    model.init_states()  # type: ignore[operator]
    return model.eval()


def _sequence_parallel_ends() -> dict[str, ParallelStyle]:
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
    }


def _dense_feed_forward(prefix: str) -> dict[str, ParallelStyle]:
    return {
        f"layers.*.{prefix}.w1": ColwiseParallel(),
        f"layers.*.{prefix}.w2": RowwiseParallel(output_layouts=Shard(1)),
        f"layers.*.{prefix}.w3": ColwiseParallel(),
    }


def llama3_plan() -> dict[str, ParallelStyle]:
    return {
        **_sequence_parallel_ends(),
        "layers.*.attention.qkv_linear.wqkv": ColwiseParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **_dense_feed_forward("feed_forward"),
    }


def deepseek_v3_plan(*, q_lora: bool) -> dict[str, ParallelStyle]:
    """Low-rank queries (671B) shard ``wq_b`` and replicate ``wq_a``; the debug model has one ``wq``."""
    queries: dict[str, ParallelStyle] = (
        {"layers.*.attention.wq_a": NoParallel(), "layers.*.attention.q_norm": NoParallel(),
         "layers.*.attention.wq_b": ColwiseParallel(use_local_output=False)}
        if q_lora else {"layers.*.attention.wq": ColwiseParallel(use_local_output=False)}
    )  # fmt: skip
    return {
        **_sequence_parallel_ends(),
        **queries,
        "layers.*.attention.wkv_a": NoParallel(),
        "layers.*.attention.kv_norm": NoParallel(),
        "layers.*.attention.wkv_b": ColwiseParallel(use_local_output=False),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        **_dense_feed_forward("feed_forward"),
        "layers.*.moe.router.gate": NoParallel(),
        **_dense_feed_forward("moe.shared_experts"),
    }
