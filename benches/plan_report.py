"""What ``meshbind check --report`` costs beside building the model on ``meta``.

    python benches/plan_report.py --runs 3

For DeepSeek-V3 (671B), Qwen3-235B-A22B and Llama 3.1 405B (configs in tests/hf_models.py, their
transformers plans): the build on ``meta``, the resolution of the stock plan, and the report
(``plan_report`` and its text, what ``--report`` prints), side by side in one run. Each figure is
the median over ``--runs`` runs; the goal is a report under 5% of the build.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from meshbind import LayoutContext, from_hf_plan, plan_report, resolve_plan

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hf_models import hf_model

CONFIGS = {"deepseek_v3": {"tp": 8, "ep": 8}, "qwen3_moe_235b": {"dp_shard": 2, "tp": 4, "ep": 8}, "llama_405b": {"tp": 8}}
"""At tp=8 Qwen3-235B-A22B's 4 key/value heads would be split (the plan is refused): tp=4."""


def one_run(name: str) -> dict[str, float]:
    started = time.perf_counter()
    model = hf_model(name, real=True)
    built = time.perf_counter()
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext(CONFIGS[name]))
    resolved = time.perf_counter()
    plan_report(model, plan).text()
    reported = time.perf_counter()
    return {"build": built - started, "resolve": resolved - built, "report": reported - resolved}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    print("| model | axes | build on meta | resolve + check | report | report / build |")
    print("|---|---|---|---|---|---|")
    for name, axes in CONFIGS.items():
        runs = [one_run(name) for _ in range(args.runs)]
        build, resolve, report = (statistics.median(run[part] for run in runs) for part in ("build", "resolve", "report"))
        share = statistics.median(run["report"] / run["build"] for run in runs)
        layout = " ".join(f"{axis}={size}" for axis, size in axes.items())
        print(
            f"| {name} | {layout} | {build * 1e3:.0f} ms | {resolve * 1e3:.1f} ms | {report * 1e3:.1f} ms | {share:.1%} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
