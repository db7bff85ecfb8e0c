"""Timing a benchmark's steps: a method on fresh models, as the binding and layout benchmarks do, or
a step run as it is."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

Model = TypeVar("Model")
Result = TypeVar("Result")
Seen = TypeVar("Seen")


def timed_on_fresh(
    setup: Callable[[], Model],
    method: Callable[[Model], object],
    observe: Callable[[Model], Seen],
    repeat: int,
    start_together: Callable[[], object] | None = None,
) -> tuple[float, list[Seen]]:
    """The median seconds of ``method`` over ``repeat`` runs, each on a model from ``setup`` with
    the garbage collector paused, and what ``observe`` reads of each model after its run. One run
    before them, untimed, warms what the first call fills (torch's caches of mesh layouts), so the
    method timed first is not the one that pays for it. ``start_together`` (a barrier, on every rank
    of a world) runs before each timed run: the ranks start each run at once, so that a rank's
    lag from untimed work before it is not counted as the next method's wait at its first
    collective."""
    method(setup())
    times, seen = [], []
    for _ in range(repeat):
        model = setup()
        gc.collect()
        if start_together is not None:
            start_together()
        gc.disable()
        try:
            start = time.perf_counter()
            method(model)
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
        seen.append(observe(model))
    return statistics.median(times), seen


def timed(step: Callable[[], Result], repeat: int) -> tuple[Result, float]:
    """The last result of ``repeat`` runs of ``step`` and their median seconds."""
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = step()
        seconds.append(time.perf_counter() - started)
    return result, statistics.median(seconds)
