"""Published pipelined layouts, split and reported on this CPU: Llama 3.1 405B at TP 8 · PP 16 ·
DP 128 (16,384 ranks, the Llama 3 paper's Table 4, DP as FSDP over ``dp_shard``) and DeepSeek-V3
671B at PP 16 · EP 64 on 2,048 ranks (its report's section 3.2; FSDP over ``dp_shard`` stands in
for its ZeRO-1, which shards the optimizer state alone).

    python benches/pipeline_split.py [--repeat 3] [--memory]

Each line gives the median seconds (of ``--repeat`` runs) to build the model on ``meta``, to
resolve its transformers plan (with the index the split reads), to split the stages (torch's own
schedule order included) and to report every stage's bytes per rank; then the fullest rank's
parameter, gradient and Adam bytes and its stages. With ``--memory``, each layout's step memory
(``meshbind check --memory``'s trace: every rank class's stages under torch's schedule, every
microbatch, on fake tensors; run once, it takes minutes) with its seconds and its highest peak.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshbind import LayoutContext, resolve_plan, step_memory
from meshbind.interop.hf_plans import from_hf_plan
from meshbind.pipeline import Pipeline, split_stages
from meshbind.report import plan_report
from meshbind.units import size_text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hf_models import hf_model
from timing import timed

LAYOUTS = {
    "llama_405b": ({"pp": 16, "dp_shard": 128, "tp": 8}, Pipeline("Interleaved1F1B", microbatches=16)),
    "deepseek_v3": ({"pp": 16, "dp_shard": 128, "ep": 64}, Pipeline("DualPipeV", microbatches=32)),
}
"""Each model's published axes and a schedule of torch's close to the one its run used."""
STEPS = {"llama_405b": (16, 8192, "full"), "deepseek_v3": (32, 4096, "none")}
"""Each step traced with ``--memory``: sequences per data-parallel rank (a microbatch each for
405B: its 2,048 sequences of the Llama 3 paper over 128 data-parallel ranks), their length, and
the activation checkpointing (405B recomputes whole blocks, as torchtitan's recipe does)."""


def measured(name: str, axes: dict[str, int], pipeline: Pipeline, repeat: int, memory: bool) -> str:
    """One model's line of the table."""
    model, build = timed(lambda: hf_model(name, real=True), repeat)
    context = LayoutContext(axes)
    plan, resolve = timed(lambda: resolve_plan(model, from_hf_plan(model), context, index=True), repeat)
    index = plan.index
    assert index is not None
    stages, split = timed(lambda: split_stages(index, axes["pp"], pipeline), repeat)
    report, reported = timed(lambda: plan_report(model, plan, pipeline=stages), repeat)
    fullest = max(report.rank_groups, key=lambda group: group.total_bytes)
    world = ", ".join(f"{axis}={size}" for axis, size in axes.items()) + f" ({context.world.size:,} ranks)"
    held = f"{size_text(fullest.total_bytes)} (stages {', '.join(map(str, fullest.stages))})"
    line = (
        f"| {name} | {world} | {stages.schedule.name}, {stages.microbatches} microbatches, {len(stages.stages)} stages "
        f"| {build:.2f} s | {resolve:.2f} s | {split:.2f} s | {reported:.2f} s | {held} |"
    )
    if memory:
        batch, seq_len, checkpointing = STEPS[name]
        traced, seconds = timed(
            lambda: step_memory(
                lambda: hf_model(name, real=True), plan, batch=batch, seq_len=seq_len,
                activation_checkpointing=checkpointing, pipeline=pipeline,
            ),
            1,
        )  # fmt: skip
        highest = max(traced.classes, key=lambda c: c.peak_bytes)
        peak = f"{size_text(highest.peak_bytes)} (ranks {highest.first_rank}+)"
        line += f" {batch} x {seq_len}, ac {checkpointing} | {seconds:.1f} s | {peak} |"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="also trace each layout's step memory, once")
    args = parser.parse_args()
    traced = " step | step memory | highest peak |" if args.memory else ""
    print(f"| model | world | schedule | meta build | resolve | split | report | fullest rank (its stages) |{traced}")
    print("|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.memory else ""))
    for name, (axes, pipeline) in LAYOUTS.items():
        print(measured(name, axes, pipeline, args.repeat, args.memory), flush=True)


if __name__ == "__main__":
    main()
