"""Step memory and step collectives of one layout from one trace of each step
(``step_memory_and_comms``, what ``meshbind plan`` and ``meshbind check --memory --comms`` run)
beside ``step_memory`` then ``step_comms``, each tracing the step itself, on Llama 3.1 8B layouts
a search of 64 GPUs traces (bf16/fp32, seq 8192; two sequences per data-parallel rank, or one per
microbatch under a pipeline).

    python benches/memory_and_comms.py [--repeat 3]

Each line: the median seconds of each way (of ``--repeat`` runs, alternated) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from step_time import LLAMA_3_1_8B, builder

from meshbind import FullyShard, LayoutContext, resolve_plan, step_comms, step_memory, step_memory_and_comms
from meshbind.interop.hf_plans import from_hf_plan
from meshbind.pipeline import Pipeline

LAYOUTS: list[tuple[dict[str, int], Pipeline | None, str]] = [
    ({"dp_shard": 64}, None, "full"),
    ({"dp_shard": 8, "tp": 8}, None, "selective-op"),
    ({"pp": 4, "dp_shard": 16}, Pipeline("1F1B", 8), "full"),
    ({"pp": 2, "dp_shard": 8, "tp": 4}, Pipeline("Interleaved1F1B", 4), "none"),
]


def measured(axes: dict[str, int], pipeline: Pipeline | None, checkpointing: str, repeat: int) -> str:
    """One layout's line of the table."""
    build = builder(LLAMA_3_1_8B)
    with torch.device("meta"):
        model = build()
    units = FullyShard(None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext(axes), fully_shard=units, index=True)
    local = pipeline.microbatches or 1 if pipeline is not None else 2
    settings: dict[str, Any] = dict(batch=local, seq_len=8192, activation_checkpointing=checkpointing, pipeline=pipeline)

    def apart() -> None:
        step_memory(build, plan, **settings)
        step_comms(build, plan, **settings)

    def together() -> None:
        step_memory_and_comms(build, plan, **settings)

    times: dict[Callable[[], None], list[float]] = {apart: [], together: []}
    for _ in range(repeat):
        for way, spent in times.items():
            started = time.perf_counter()
            way()
            spent.append(time.perf_counter() - started)
    separate, combined = (statistics.median(spent) for spent in times.values())
    world = " · ".join(f"{axis} {size}" for axis, size in axes.items())
    schedule = f"{pipeline.schedule}, {pipeline.microbatches} microbatches" if pipeline is not None else "—"
    return f"| {world} | {schedule} | {checkpointing} | {separate:.1f} s | {combined:.1f} s | {separate / combined:.2f}x |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| layout | schedule | checkpointing | step_memory, then step_comms | step_memory_and_comms | ratio |")
    print("|---|---|---|---|---|---|")
    for axes, pipeline, checkpointing in LAYOUTS:
        print(measured(axes, pipeline, checkpointing, args.repeat), flush=True)


if __name__ == "__main__":
    main()
