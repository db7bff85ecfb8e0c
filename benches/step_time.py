"""Step time beside torchtitan's published throughput, on this CPU: Llama 3.1 8B under FSDP on 8
and 128 H100s, local batch 2, seq 8192, bf16/fp32 mixed precision and selective (per-operator)
activation checkpointing, without Float8 or torch.compile (torchtitan's
``benchmarks/llama3_h100_202412_torchtitan.md``, Tables 1 and 3: 5,762 and 5,605 tokens/s per GPU).

    python benches/step_time.py [--repeat 3]

Each line gives meshbind's estimate of tokens/s per GPU and MFU on ``H100-SXM`` data-sheet peaks,
the published figure, the error, and the median seconds (of ``--repeat`` runs) the trace and the
estimate took. torchtitan's H100s ran at 500 W with HBM2e (2.4 TB/s): slower than the SXM sheet.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from meshbind import FullyShard, LayoutContext, resolve_plan, step_comms
from meshbind.steptime.cluster import GPUS, Cluster
from meshbind.steptime.estimate import step_time

LLAMA_3_1_8B = dict(
    num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, rope_theta=500000.0,
)  # fmt: skip
"""Llama 3.1 8B's published config."""
PUBLISHED = {8: 5762, 128: 5605}
"""torchtitan's tokens/s per GPU for FSDP on 8 and 128 H100s (Tables 1 and 3)."""


def build() -> Any:
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA_3_1_8B), dtype=torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each figure; the median is shown")
    args = parser.parse_args()
    units = FullyShard(("model.layers.*",), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    cluster = Cluster(GPUS["H100-SXM"])
    print("| run | published tokens/s/GPU | estimate | error | estimated MFU | traced and priced in |")
    print("|---|---|---|---|---|---|")
    for gpus, published in PUBLISHED.items():
        runs = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            with torch.device("meta"):
                model = build()
            plan = resolve_plan(model, [], LayoutContext({"dp_shard": gpus}), fully_shard=units, index=True)
            comms = step_comms(build, plan, batch=2, seq_len=8192, activation_checkpointing="selective-op")
            answer = step_time(comms, cluster)
            runs.append(time.perf_counter() - started)
        estimate = answer.tokens_per_second_per_gpu
        print(
            f"| Llama 3.1 8B, FSDP {gpus}, local batch 2, seq 8192 | {published:,} | {estimate:,.0f} "
            f"| {estimate / published - 1:+.0%} | {answer.mfu:.1%} | {statistics.median(runs):.1f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
