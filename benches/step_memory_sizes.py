"""Step memory at published sizes, on this CPU: DeepSeek-V3 671B, Qwen3-235B-A22B and Llama 3.1 405B
at the 256-rank FSDP worlds of ``tests/test_report.py``, one 4096-token sequence per rank, Adam,
in float32 and in torchtitan's default mixed precision (float32 shards and Adam state, each unit
gathered and computed in bfloat16, gradients reduced in float32), with and without full activation
checkpointing.

    python benches/step_memory_sizes.py [--seq-len 4096] [--models deepseek_v3 ...] [--repeat 3]

Each line gives the median seconds (of ``--repeat`` runs) to build the model on ``meta`` beside the
median seconds ``step_memory`` takes (its own builds included), the peak per rank and how it was
traced (alike decoder layers at three depths, extrapolated where exact). Experts run
transformers' ``grouped_mm``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from meshbind import FullyShard, LayoutContext, StepMemory, UnitPrecision, resolve_plan, step_memory
from meshbind.interop.hf_plans import from_hf_plan
from meshbind.units import size_text

from timing import timed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_report import DENSE_UNITS, FSDP_UNITS, FSDP_WORLDS

from hf_models import MODEL_TYPES, REAL

ROUTER = "model.layers.*.mlp.gate"
UNITS = {"deepseek_v3": FullyShard(("model.layers.*.mlp.experts", ROUTER, "model.layers.*"))}
"""DeepSeek-V3's router keeps its score-correction bias in float32 (transformers keeps it so):
the router is a unit of its own, as FSDP gathers a unit in one dtype; in mixed precision it stays
a float32 unit (``UnitPrecision``), its output handed on in bfloat16."""
PRECISIONS = ("float32", "bf16/fp32")


def build(name: str) -> Any:
    config = AutoConfig.for_model(MODEL_TYPES.get(name, name), **REAL[name])
    if any(getattr(config, field, None) for field in ("num_experts", "n_routed_experts")):
        config._experts_implementation = "grouped_mm"  # the default loops over the experts a batch hit
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def on_meta(name: str) -> Any:
    with torch.device("meta"):
        return build(name)


def mixed(units: FullyShard) -> FullyShard:
    """``units`` in bf16/fp32 mixed precision, a router unit kept in float32."""
    in_float32 = UnitPrecision(ROUTER, param_dtype=torch.float32, output_dtype=torch.bfloat16)
    routers = (in_float32,) if ROUTER in (units.units or ()) else ()
    return replace(units, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, unit_policies=routers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--models", nargs="+", choices=list(FSDP_WORLDS), default=list(FSDP_WORLDS))
    parser.add_argument("--repeat", type=int, default=3, help="runs of each figure; the median is shown")
    args = parser.parse_args()
    print("| model | world | precision | checkpointing | meta build | step_memory | peak per rank | traced |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        axes = FSDP_WORLDS[name]
        units: FullyShard = UNITS.get(name, FSDP_UNITS if "ep" in axes else DENSE_UNITS)
        model, built = timed(lambda name=name: on_meta(name), args.repeat)
        for precision, checkpointing in ((p, c) for p in PRECISIONS for c in ("none", "full")):
            fully_shard = units if precision == "float32" else mixed(units)

            def traced(
                name: str = name, model: Any = model, axes: dict[str, int] = axes, fully_shard: FullyShard = fully_shard,
                checkpointing: str = checkpointing,
            ) -> StepMemory:  # fmt: skip
                plan = resolve_plan(model, from_hf_plan(model), LayoutContext(axes), fully_shard=fully_shard, index=True)
                return step_memory(
                    lambda: build(name), plan, batch=1, seq_len=args.seq_len, activation_checkpointing=checkpointing
                )

            answer, seconds = timed(traced, args.repeat)
            (only,) = answer.classes
            world = ", ".join(f"{axis}={size}" for axis, size in axes.items())
            print(
                f"| {name} | {world} | {precision} | {checkpointing} | {built:.1f} s | {seconds:.1f} s | "
                f"{size_text(only.peak_bytes)} "
                f"in {only.peak_module} {only.peak_phase} | {only.traced} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
