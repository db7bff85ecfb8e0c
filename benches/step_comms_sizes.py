"""Step collectives at published sizes, on this CPU: DeepSeek-V3 671B, Qwen3-235B-A22B and Llama
3.1 405B at the 256-rank FSDP worlds of ``tests/test_report.py`` (as ``step_memory_sizes.py``), one
4096-token sequence per rank, Adam, in torchtitan's default mixed precision (each unit gathered and
computed in bfloat16, gradients reduced in float32).

    python benches/step_comms_sizes.py [--seq-len 4096] [--models deepseek_v3 ...] [--repeat 3]

Each line gives the median seconds (of ``--repeat`` runs) to build the model on ``meta`` beside the
median seconds ``step_comms`` takes (its own builds included), what one rank sends in the step
(its calls and bytes, every kind and group together) and how it was traced.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from step_memory_sizes import UNITS, build, mixed, on_meta

from meshbind import FullyShard, LayoutContext, StepComms, resolve_plan, step_comms
from meshbind.interop.hf_plans import from_hf_plan
from meshbind.units import size_text

from timing import timed

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_report import DENSE_UNITS, FSDP_UNITS, FSDP_WORLDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--models", nargs="+", choices=list(FSDP_WORLDS), default=list(FSDP_WORLDS))
    parser.add_argument("--repeat", type=int, default=3, help="runs of each figure; the median is shown")
    args = parser.parse_args()
    print("| model | world | meta build | step_comms | one rank's calls | one rank's bytes | traced |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        axes = FSDP_WORLDS[name]
        units: FullyShard = UNITS.get(name, FSDP_UNITS if "ep" in axes else DENSE_UNITS)
        model, built = timed(lambda name=name: on_meta(name), args.repeat)

        def traced(name: str = name, model: Any = model, axes: dict[str, int] = axes, units: FullyShard = units) -> StepComms:
            plan = resolve_plan(model, from_hf_plan(model), LayoutContext(axes), fully_shard=mixed(units), index=True)
            return step_comms(lambda: build(name), plan, batch=1, seq_len=args.seq_len)

        answer, seconds = timed(traced, args.repeat)
        (only,) = answer.classes
        calls = sum(collective.count for collective in only.collectives)
        sent = sum(collective.bytes for collective in only.collectives)
        world = ", ".join(f"{axis}={size}" for axis, size in axes.items())
        print(
            f"| {name} | {world} | {built:.1f} s | {seconds:.1f} s | {calls} | {size_text(sent)} | {only.traced} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
