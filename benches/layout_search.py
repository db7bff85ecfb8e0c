"""``meshbind plan`` beside published layouts, on this CPU.

- torchtitan's Llama 3.1 8B at FSDP 8 and FSDP 128 (``benchmarks/llama3_h100_202412_torchtitan.md``:
  local batch 2, seq 8192);
- torchtitan's Llama 3.1 405B at FSDP 8 · TP 8 · PP 8 on 512 H100s, under 1F1B and interleaved
  1F1B with full activation checkpointing (torchtitan's 405B recipe), 16 sequences of 8192 per
  data-parallel rank, a microbatch per sequence;
- DeepSeek-V3 671B at PP 16 · EP 64 on 2,048 GPUs under DualPipeV (FSDP 128 standing in for its
  ZeRO-1, 32 sequences of 4096 per data-parallel rank).

    python benches/layout_search.py [--runs 8b-8 8b-128 405b-1f1b 405b-interleaved dsv3] [--full]
        [--time-limit SECONDS]

For each: the search's rules pass over every layout of the GPU count (each world, schedule,
microbatches, checkpointing, bf16/fp32 precision: refused by check's rules, or its state counted
by the report's arithmetic) and the seconds it took; whether the published layout passes the
rules and its state fits 80 GiB; and the published layout traced and priced with the calls
``meshbind check --memory --comms --step-time`` makes (peak, fits, tokens/s per GPU). With
``--full`` the whole search runs (every valid layout traced) and the published layout's rank is
shown (a published layout that does not fit is not ranked, and needs no search to say so): at
these sizes that takes from most of an hour (8B on 8 GPUs) to days on this machine. With
``--time-limit`` the search a user would run (every schedule) also runs under that limit, as
``meshbind plan --time-limit`` does: how many layouts it traced by then, the best of them, and the
published layout's place among them.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from step_memory_sizes import build as published_model
from step_time import LLAMA_3_1_8B, LLAMA_3_1_405B, builder

from meshbind import (
    GPUS,
    Cluster,
    FullyShard,
    LayoutContext,
    StepMemory,
    StepTime,
    resolve_plan,
    step_memory_and_comms,
    step_time,
)
from meshbind.interop.hf_plans import from_hf_plan
from meshbind.pipeline import Pipeline
from meshbind.search import Candidate, Choices, LayoutSearch, plan_layouts
from meshbind.search.result import STATE_TOO_LARGE
from meshbind.units import size_text

DEVICE_MEMORY = 80 * 2**30
CLUSTER = Cluster(GPUS["H100-SXM"])


@dataclass(frozen=True)
class Run:
    name: str
    build: Callable[[], Any]
    gpus: int
    axes: dict[str, int]
    local_batch: int
    seq_len: int
    schedule: str | None = None
    checkpointing: str = "selective-op"

    @property
    def global_batch(self) -> int:
        return self.local_batch * self.axes.get("dp_replicate", 1) * self.axes.get("dp_shard", 1)

    def published(self, candidate: Candidate) -> bool:
        layout = candidate.layout
        return (
            layout is not None
            and {a: s for a, s in layout.world.axis_sizes().items() if s > 1} == self.axes
            and layout.schedule == self.schedule
            and (self.schedule is None or layout.microbatches == self.local_batch)
            and str(layout.checkpointing) == self.checkpointing
            and layout.param_dtype == "bf16"
        )


RUNS = {
    "8b-8": Run("Llama 3.1 8B, FSDP 8", builder(LLAMA_3_1_8B), 8, {"dp_shard": 8}, 2, 8192),
    "8b-128": Run("Llama 3.1 8B, FSDP 128", builder(LLAMA_3_1_8B), 128, {"dp_shard": 128}, 2, 8192),
    "405b-1f1b": Run("Llama 3.1 405B, FSDP 8 · TP 8 · PP 8, 1F1B", builder(LLAMA_3_1_405B), 512,
                     {"pp": 8, "dp_shard": 8, "tp": 8}, 16, 8192, "1F1B", "full"),
    "405b-interleaved": Run("Llama 3.1 405B, FSDP 8 · TP 8 · PP 8, Interleaved1F1B", builder(LLAMA_3_1_405B), 512,
                            {"pp": 8, "dp_shard": 8, "tp": 8}, 16, 8192, "Interleaved1F1B", "full"),
    "dsv3": Run("DeepSeek-V3 671B, PP 16 · EP 64 · FSDP 128, DualPipeV", lambda: published_model("deepseek_v3"), 2048,
                {"pp": 16, "dp_shard": 128, "ep": 64}, 32, 4096, "DualPipeV", "none"),
}  # fmt: skip


def search(
    run: Run, model: Any, trace: bool, schedules: list[str] | None = None, time_limit: float | None = None
) -> LayoutSearch:
    def progress(what: str, done: int, total: int) -> None:
        print(f"\r{run.name}: {what} {done:,} of {total:,}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    return plan_layouts(
        model,
        from_hf_plan(model),
        build=run.build,
        gpus=run.gpus,
        cluster=CLUSTER,
        device_memory=DEVICE_MEMORY,
        global_batch=run.global_batch,
        seq_len=run.seq_len,
        choices=Choices(schedules, param_dtypes=["bf16", "fp32"]),
        trace=trace,
        progress=progress if trace else None,
        time_limit=time_limit,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--full", action="store_true", help="trace every valid layout and rank the published one")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS", help="also search under this limit (every schedule)")
    args = parser.parse_args()
    columns = ["published layout", "GPUs", "candidates", "valid", "state fits", "rules pass", "passes the rules"]
    columns += ["peak", "fits", "tokens/s/GPU", "traced in", "rank"]
    columns += [f"in {args.time_limit:g} s: traced, the best, the published's place"] if args.time_limit else []
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for run in (RUNS[name] for name in args.runs):
        with torch.device("meta"):
            model = run.build()
        rules = search(run, model, trace=False)
        valid = [c for c in rules.candidates if c.rule in (None, STATE_TOO_LARGE)]
        published = next((c for c in rules.candidates if run.published(c)), None)
        passes = "not a candidate" if published is None else (published.rule or "yes")
        started = time.perf_counter()
        own = _traced_alone(run) if published is not None and published.rule is None else None
        seconds = time.perf_counter() - started
        rank = "—"
        if own is not None and own[0].fits is False:
            rank = "not ranked: it does not fit"  # a layout that does not fit is never ranked: no search needed
        elif args.full:
            traced = search(run, model, trace=True, schedules=[run.schedule] if run.schedule else None)
            position = next((n for n, c in enumerate(traced.ranked, 1) if run.published(c)), None)
            rank = f"{position} of {len(traced.ranked)}" if position else "not ranked"
            rank += f" (searched in {traced.seconds / 60:.0f} min)"
            print(traced.text(), file=sys.stderr, flush=True)
        figures = "| — | — | — | — "
        if own is not None:
            memory, timed = own
            speed = f"{timed.tokens_per_second_per_gpu:,.0f}" if timed is not None else "—"
            figures = f"| {size_text(memory.peak_bytes)} | {'yes' if memory.fits else 'no'} | {speed} | {seconds:.0f} s "
        limited = "" if args.time_limit is None else f" {_within(run, model, args.time_limit)} |"
        print(
            f"| {run.name} | {run.gpus:,} | {len(rules.candidates):,} | {len(valid):,} "
            f"| {sum(c.state_bytes is not None and c.state_bytes <= DEVICE_MEMORY for c in valid):,} "
            f"| {rules.seconds:.1f} s | {passes} {figures}| {rank} |{limited}",
            flush=True,
        )


def _within(run: Run, model: Any, time_limit: float) -> str:
    """The search a user runs, stopped at ``time_limit``: how far it got, and the published layout's place."""
    found = search(run, model, trace=True, time_limit=time_limit)
    traced = sum(1 for c in found.candidates if c.memory is not None)
    if not found.ranked:
        return f"{traced:,} traced, none fits"
    best = found.ranked[0]
    assert best.time is not None and best.layout is not None
    published = next((c for c in found.candidates if run.published(c)), None)
    if published is None or published.memory is None:
        place = "not traced by then"
    elif published.fits:
        place = f"{next(n for n, c in enumerate(found.ranked, 1) if c is published)} of {len(found.ranked)}"
    else:
        place = "traced: does not fit"
    return f"{traced:,} traced; {best.time.tokens_per_second_per_gpu:,.0f} ({best.layout.text()}); {place}"


def _traced_alone(run: Run) -> tuple[StepMemory, StepTime | None]:
    """The published layout traced and priced with the calls ``meshbind check`` makes."""
    with torch.device("meta"):
        model = run.build()
    units = FullyShard(None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext(run.axes), fully_shard=units, index=True)
    pipeline = Pipeline(run.schedule, microbatches=run.local_batch) if run.schedule else None
    settings: dict[str, Any] = dict(
        batch=run.local_batch, seq_len=run.seq_len, activation_checkpointing=run.checkpointing, pipeline=pipeline
    )
    memory, comms = step_memory_and_comms(run.build, plan, device_memory=DEVICE_MEMORY, **settings)
    return memory, step_time(comms, CLUSTER) if memory.fits else None


if __name__ == "__main__":
    main()
