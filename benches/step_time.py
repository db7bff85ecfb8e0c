"""Step time beside published runs, on this CPU.

- Llama 3.1 8B under FSDP on 8 and 128 H100s, local batch 2, seq 8192, bf16/fp32 mixed precision
  and selective (per-operator) activation checkpointing, without Float8 or torch.compile
  (torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md``, Tables 1 and 3: 5,762 and 5,605
  tokens/s per GPU). torchtitan's H100s ran at 500 W with HBM2e (2.4 TB/s).
- Llama 3.1 405B at TP 8 · PP 16 · DP 128 on 16,384 H100s, seq 8192, 16 sequences per
  data-parallel rank (the Llama 3 paper, Table 4: 41% MFU, 400 TFLOPs per GPU), under torchtitan's
  interleaved 1F1B (two stages per rank, a microbatch per sequence), bf16/fp32, no checkpointing:
  the paper's own schedule and its tuning are not published in full.
- DeepSeek-V3 671B at PP 16 · EP 64 on 2,048 ranks under DualPipeV (its report's section 3.2; FSDP
  over ``dp_shard`` standing in for its ZeRO-1), 32 sequences of 4096 per data-parallel rank,
  bf16/fp32: for the time the answer takes. Nothing published compares (it trained in FP8 on H800s).

    python benches/step_time.py [--repeat 3] [--runs 8b 405b dsv3]

Each line gives meshbind's estimate of tokens/s per GPU and MFU on ``H100-SXM`` data-sheet peaks,
the published figure, the error, and the median seconds (of ``--repeat`` runs) the trace and the
estimate took.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from step_memory_sizes import UNITS, mixed
from step_memory_sizes import build as published_model
from transformers import AutoConfig, AutoModelForCausalLM

from meshbind import GPUS, Cluster, FullyShard, LayoutContext, StepTime, resolve_plan, step_comms, step_time
from meshbind.interop.hf_plans import from_hf_plan
from meshbind.pipeline import Pipeline

from timing import timed

LLAMA_3_1_8B = dict(
    num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, rope_theta=500000.0,
)  # fmt: skip
LLAMA_3_1_405B = LLAMA_3_1_8B | dict(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128)
"""Llama 3.1 8B's and 405B's published configs."""


LLAMA_UNITS = FullyShard(("model.layers.*",), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@dataclass(frozen=True)
class Run:
    name: str
    build: Callable[[], Any]
    axes: dict[str, int]
    batch: int
    checkpointing: str
    pipeline: Pipeline | None
    published: str
    """The published figure, as published."""
    error: Callable[[StepTime], float] | None
    """The estimate's error against it; ``None`` where nothing published compares."""
    hf_plan: bool = False
    seq_len: int = 8192
    units: FullyShard = LLAMA_UNITS


def builder(config: dict[str, Any]) -> Callable[[], Any]:
    return lambda: AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config), dtype=torch.float32)


RUNS = {
    "8b": [
        Run(f"Llama 3.1 8B, FSDP {gpus}, local batch 2, seq 8192", builder(LLAMA_3_1_8B), {"dp_shard": gpus}, 2,
            "selective-op", None, f"{tokens:,} tokens/s/GPU",
            lambda answer, tokens=tokens: answer.tokens_per_second_per_gpu / tokens - 1)
        for gpus, tokens in ((8, 5762), (128, 5605))
    ],
    "405b": [
        Run("Llama 3.1 405B, TP 8 · PP 16 · DP 128, 16 sequences of 8192 per DP rank", builder(LLAMA_3_1_405B),
            {"pp": 16, "dp_shard": 128, "tp": 8}, 16, "none", Pipeline("Interleaved1F1B", microbatches=16), "41% MFU",
            lambda answer: (answer.mfu or 0) / 0.41 - 1, hf_plan=True),
    ],
    "dsv3": [
        Run("DeepSeek-V3 671B, PP 16 · EP 64 · FSDP 128, DualPipeV, 32 sequences of 4096 per DP rank",
            lambda: published_model("deepseek_v3"), {"pp": 16, "dp_shard": 128, "ep": 64}, 32, "none",
            Pipeline("DualPipeV", microbatches=32), "none alike (FP8 on H800s)", None, hf_plan=True, seq_len=4096,
            units=mixed(UNITS["deepseek_v3"])),
    ],
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each figure; the median is shown")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    args = parser.parse_args()
    cluster = Cluster(GPUS["H100-SXM"])
    print("| run | published | tokens/s/GPU | MFU | error | traced and priced in |")
    print("|---|---|---|---|---|---|")
    for run in (run for name in args.runs for run in RUNS[name]):

        def estimated(run: Run = run) -> StepTime:
            with torch.device("meta"):
                model = run.build()
            requests = from_hf_plan(model) if run.hf_plan else []
            plan = resolve_plan(model, requests, LayoutContext(run.axes), fully_shard=run.units, index=True)
            comms = step_comms(
                run.build,
                plan,
                batch=run.batch,
                seq_len=run.seq_len,
                activation_checkpointing=run.checkpointing,
                pipeline=run.pipeline,
            )
            return step_time(comms, cluster)

        answer, seconds = timed(estimated, args.repeat)
        print(
            f"| {run.name} | {run.published} | {answer.tokens_per_second_per_gpu:,.0f} | {answer.mfu:.1%} "
            f"| {'—' if run.error is None else f'{run.error(answer):+.0%}'} | {seconds:.1f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
