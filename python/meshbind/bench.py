"""``meshbind bench``: how long resolving your plan over your model takes, phase by phase.

    meshbind bench my_model:build my_plan:REQUESTS --axis tp=8
    meshbind bench --hf-config config.json --axis tp=8 --axis ep=8
    meshbind bench        # the embedded default: DeepSeek-V3's 61 layers x 256 experts, every projection planned

Each run resolves the plan from scratch (``resolve_plan``) and builds its per-rank report
(``plan_report``), the garbage collector paused; the figures are the medians of ``--repeat`` runs
after one untimed run. Resolution's progress calls tell the phases apart: ``walk`` (the match over
the tree, up to one record per selected module), ``resolve`` (ownership, families, providers,
overrides), ``validate`` (the per-module rules), ``report``. The comparison against other ways of
matching a plan (torch's ``parallelize_module``, fnmatch, regular expressions) lives in the
repository's ``benches/``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from meshbind._core import PatternSet
from meshbind.report import plan_report
from meshbind.resolution import resolve_plan
from meshbind.specs import LayoutContext, NativeParallelBindingRequest, PlanSource

PHASES = ("walk", "resolve", "validate", "report")


@dataclass(frozen=True)
class ResolutionTimes:
    """The median seconds of each phase and of the whole, over ``runs`` runs."""

    model: str
    modules: int
    """Modules in the tree."""
    planned: int
    runs: int
    phases: dict[str, float]
    total: float

    def text(self) -> str:
        runs = "one run" if self.runs == 1 else f"the median of {self.runs} runs"
        lines = [f"{self.model}: {self.modules:,} modules, {self.planned:,} planned; {runs}"]
        lines += [f"  {phase:<9} {self.phases[phase] * 1e3:10.2f} ms" for phase in PHASES]
        lines.append(f"  {'total':<9} {self.total * 1e3:10.2f} ms")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        seconds = {f"{phase}_s": self.phases[phase] for phase in PHASES}
        return {
            "model": self.model,
            "modules": self.modules,
            "planned": self.planned,
            "runs": self.runs,
            **seconds,
            "total_s": self.total,
        }


class _PhaseClock:
    """Hears resolution's progress calls and notes when each of its phases ended."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.ended: dict[str, float] = {}

    def __call__(self, step: str, done: int, total: int) -> None:
        if step == "walk" and done == total:
            self.ended["walk"] = time.perf_counter()
        elif step == "validation":
            self.ended["resolve" if done == 0 else "validate"] = time.perf_counter()

    def phases(self, finished: float) -> dict[str, float]:
        marks = [self.started, *(self.ended[phase] for phase in PHASES[:-1]), finished]
        return {phase: end - start for phase, start, end in zip(PHASES, marks, marks[1:], strict=False)}


def time_resolution(
    model: nn.Module,
    requests: Sequence[NativeParallelBindingRequest] | PlanSource,
    context: LayoutContext,
    *,
    repeat: int = 5,
) -> ResolutionTimes:
    """Times ``resolve_plan`` and ``plan_report`` on ``model``; raises ``PlanError`` as resolution does."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    plan = resolve_plan(model, requests, context)  # untimed: fills what a first call fills
    runs: list[dict[str, float]] = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            clock = _PhaseClock()
            plan = resolve_plan(model, requests, context, progress=clock)
            plan_report(model, plan)
            runs.append(clock.phases(time.perf_counter()))
        finally:
            gc.enable()
    phases = {phase: statistics.median(run[phase] for run in runs) for phase in PHASES}
    total = statistics.median(sum(run.values()) for run in runs)
    modules = PatternSet([]).walk(model, prune=False).module_count
    return ResolutionTimes(type(model).__name__, modules, len(plan.parallel_modules), repeat, phases, total)
