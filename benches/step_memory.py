"""One training step's peak bytes per rank: the measured truth beside meshbind's traced estimate
and the two published anchors, on the same work, in one run.

    python benches/step_memory.py

For each configuration of ``tests/test_step_memory.py`` (the demo at 4 and 8 ranks, a small Llama
at ``tp=2 dp_shard=2``, a small Qwen3-MoE at ``ep=2`` with balanced routing; each with and without
full activation checkpointing; float32, Adam, the step after the first, on the CPU):

- ``measured``: every rank of a gloo world runs the step under ``torch.profiler`` (the CPU
  allocator's record); the largest rank's peak;
- ``meshbind``: ``step_memory(..., device="cpu")``, traced with fake tensors;
- ``megatron``: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv 2205.05198), Table 2: activations per layer ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``
  bytes with tensor parallelism (``s*b*h*(34 + 5*a*s/h)`` without), ``2*s*b*h`` with full
  recomputation, times the layers; plus Megatron-LM's model states
  (``theoretical_memory_usage.py``: 18 bytes per parameter, ``6 + 12/dp`` with its distributed
  optimizer, which FSDP corresponds to). As written: 16-bit activations, no MoE term, no CP term
  (``s`` is the sequence a rank holds);
- ``deepspeed``: DeepSpeed's model-states estimators (``estimate_zero3_model_states_mem_needs``
  under FSDP: ``4 * largest_layer_params + 18 * params / ranks``;
  ``estimate_zero2_model_states_mem_needs`` otherwise: ``4 * params + 16 * params / ranks``),
  activations not counted.

Each estimate's error is ``estimate / measured - 1``. The parameters per rank the anchors take
are the plan report's (exact), so the anchors are judged on their formulas only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from meshbind import FullyShard, LayoutContext, plan_report, resolve_plan, step_memory
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.launch import run_local_world

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from step_memory_checks import DEMO_UNITS, hf_transformer

SEQ_LEN = 32


@dataclass(frozen=True)
class Config:
    name: str
    axes: dict[str, int]
    batch: int
    seq_len: int
    units: tuple[str, ...]
    build: Callable[[], nn.Module]
    requests: Callable[[nn.Module], Any]
    truth: Callable[[str], tuple[str, tuple[Any, ...]]]
    """Checkpointing → the measuring function and its arguments on every rank (one peak in a list)."""


def _demo(axes: dict[str, int], batch: int) -> Config:
    units = DEMO_UNITS.units if axes.get("dp_shard", 1) > 1 else ()

    def truth(checkpointing: str) -> tuple[str, tuple[Any, ...]]:
        return "step_memory_checks:demo_step_peaks", (axes, 2, 8, batch, SEQ_LEN, [checkpointing])

    return Config(
        f"demo {LayoutContext(axes).world.text()}",
        axes,
        batch,
        SEQ_LEN,
        units,
        lambda: MoETransformer(TransformerConfig(layers=2, experts=8)),
        lambda model: [loss_head_request()],
        truth,
    )


def _hf(name: str, axes: dict[str, int], units: tuple[str, ...]) -> Config:
    from meshbind.interop.hf_plans import from_hf_plan

    def truth(checkpointing: str) -> tuple[str, tuple[Any, ...]]:
        return "step_memory_checks:hf_step_peaks", (name, axes, FullyShard(units) if units else None, 2, 64, [checkpointing])

    return Config(
        f"{name} {LayoutContext(axes).world.text()}",
        axes,
        2,
        64,
        units,
        lambda: hf_transformer(name),
        from_hf_plan,
        truth,
    )


def configurations() -> list[Config]:
    return [
        _demo({"cp": 2, "tp": 2, "ep": 2}, 4),
        _demo({"dp_shard": 2, "cp": 2, "tp": 2, "ep": 4}, 2),
        _hf("llama", {"dp_shard": 2, "tp": 2}, ("model.layers.*",)),
        _hf("qwen3_moe", {"dp_shard": 2, "ep": 2}, ()),
    ]


def _shape(model: nn.Module) -> tuple[int, int, int]:
    """Hidden size, attention heads and layers, from a transformers config or the demo's."""
    config = model.config
    if hasattr(config, "hidden_size"):
        return config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    return config.hidden, config.heads, config.layers


def anchors(config: Config, checkpointing: str) -> tuple[int, int]:
    """Megatron's formula and DeepSpeed's model-states estimate, in bytes, for one rank."""
    with torch.device("meta"):
        model = config.build()
    world = LayoutContext(config.axes).world
    plan = resolve_plan(model, config.requests(model), LayoutContext(config.axes))
    per_rank = plan_report(model, plan, optimizer="none").ranks[0].parameter_bytes // 4  # float32 parameters
    total = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    h, a, layers = _shape(model)
    s, b, t = config.seq_len // world.cp, config.batch, world.tp
    if checkpointing == "full":
        per_layer = 2 * s * b * h
    elif t > 1:
        per_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    else:
        per_layer = s * b * h * (34 + 5 * a * s / h)
    sharded = bool(config.units)
    dp = world.dp_shard * world.cp
    megatron_states = per_rank * ((6 + 12 / dp) if sharded else 18)
    megatron = int(layers * per_layer + megatron_states)
    ranks = world.size
    deepspeed = int(4 * largest + 18 * total / ranks) if sharded else int(4 * total + 16 * total / ranks)
    return megatron, deepspeed


def run(config: Config, checkpointing: str) -> dict[str, int]:
    with torch.device("meta"):
        model = config.build()
    units = FullyShard(config.units) if config.units else None
    plan = resolve_plan(model, config.requests(model), LayoutContext(config.axes), fully_shard=units, index=True)
    estimate = step_memory(
        config.build,
        plan,
        batch=config.batch,
        seq_len=config.seq_len,
        activation_checkpointing=checkpointing,
        device="cpu",
    ).peak_bytes
    target, arguments = config.truth(checkpointing)
    measured = max(peaks[0] for peaks in run_local_world(LayoutContext(config.axes).world.size, target, *arguments, timeout=300))
    megatron, deepspeed = anchors(config, checkpointing)
    return {"measured": measured, "meshbind": estimate, "megatron": megatron, "deepspeed": deepspeed}


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print("| configuration | checkpointing | measured | meshbind | Megatron formula | DeepSpeed model states |")
    print("|---|---|---|---|---|---|")
    for config in configurations():
        for checkpointing in ("none", "full"):
            row = run(config, checkpointing)
            measured = row["measured"]
            cells = [f"{row[m] / 2**20:.2f} MiB ({row[m] / measured - 1:+.1%})" for m in ("meshbind", "megatron", "deepspeed")]
            print(f"| {config.name} | {checkpointing} | {measured / 2**20:.2f} MiB | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
