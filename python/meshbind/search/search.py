"""``plan_layouts``: every layout of a cluster checked by the rules ``meshbind check`` applies,
each valid one's state counted by the report's arithmetic, and those whose state fits traced and
priced exactly as ``meshbind check --memory --comms --step-time`` traces and prices them."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from torch import nn

from meshbind.comms.with_memory import step_memory_and_comms
from meshbind.errors import StepMemoryError
from meshbind.forks import in_forks
from meshbind.memory.trace import step_memory
from meshbind.names import ActivationCheckpointing, Optimizer
from meshbind.routing import Routing
from meshbind.search.result import CANNOT_BE_TRACED, STATE_TOO_LARGE, Candidate, LayoutSearch
from meshbind.search.rules import Progress, Rules, checked_by_the_rules, nearest_usable
from meshbind.search.space import Choices, Layout, worlds
from meshbind.steptime.cluster import Cluster
from meshbind.steptime.estimate import step_time


def plan_layouts(
    model: nn.Module,
    requests: Any,
    *,
    build: Callable[[], nn.Module],
    gpus: int,
    cluster: Cluster,
    device_memory: int,
    global_batch: int,
    seq_len: int,
    optimizer: str = Optimizer.ADAM,
    choices: Choices | None = None,
    device: str = "cuda",
    routing: Routing | None = None,
    progress: Progress | None = None,
    trace: bool = True,
    time_limit: float | None = None,
) -> LayoutSearch:
    """Every layout of ``gpus`` GPUs for ``model`` (on meta) under ``requests`` (meshbind's
    requests or a plan source such as ``from_hf_plan(model)``), ``global_batch`` sequences of
    ``seq_len`` tokens a step: refused with the rule that refuses it, or traced and priced. Each
    trace runs on a model ``build()`` makes (under ``torch.device("meta")``), as ``step_memory``'s do.

    A layout whose state alone (the report's fullest rank) exceeds ``device_memory`` is not
    traced: its step holds at least that much. Every other valid layout is traced (step memory and
    step collectives from one trace of each step, ``step_memory_and_comms``, as ``meshbind check
    --memory --comms`` traces them) and priced on ``cluster``, so its figures are check's. Ctrl-C
    stops the tracing and returns what was found so far (``interrupted``); so does the end of
    ``time_limit`` seconds from the start (``out_of_time``; the rules pass always finishes, as
    nothing can be listed without it). Without ``trace``,
    nothing is traced: every candidate is refused by a rule, too large by its state, or valid with
    its state counted (and nothing is ranked)."""
    started = time.perf_counter()
    for name, value in (("gpus", gpus), ("global_batch", global_batch), ("seq_len", seq_len), ("device_memory", device_memory)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if time_limit is not None:
        if isinstance(time_limit, bool) or not isinstance(time_limit, int | float) or not time_limit >= 0:
            raise ValueError(f"time_limit must be a number of seconds, 0 or more, got {time_limit!r}")
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("time_limit is kept by SIGALRM, which only the main thread receives: search from the main thread")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    wanted = (choices or Choices()).checked()
    if wanted.expert_parallel is None:
        wanted = replace(wanted, expert_parallel=any(fqn.rpartition(".")[2] == "experts" for fqn, _ in model.named_modules()))
    rules = Rules(model, requests, wanted, cluster, global_batch, seq_len, optimizer)
    candidates = checked_by_the_rules(rules, list(worlds(gpus, bool(wanted.expert_parallel))), device_memory, progress)
    passed = any(c.rule in (None, STATE_TOO_LARGE) for c in candidates)
    nearest = None if passed else nearest_usable(rules, gpus, bool(wanted.expert_parallel), device_memory)
    fitting = [position for position, c in enumerate(candidates) if c.rule is None]
    to_trace = sorted(fitting, key=lambda p: _likely_fastest_first(candidates[p])) if trace else []
    traced = _Tracer(build, rules, device_memory, device, routing or Routing())
    interrupted = out_of_time = False
    done = 0

    def answered(position: int, found: Candidate) -> None:
        nonlocal done
        candidates[to_trace[position]] = found
        done += 1
        if progress is not None:
            progress("tracing layouts", done, len(to_trace))

    try:
        with _alarm_after(None if time_limit is None else time_limit - (time.perf_counter() - started)):
            if progress is not None and to_trace:
                progress("tracing layouts", 0, len(to_trace))
            in_forks(traced.full, [candidates[p] for p in to_trace], _tracing, answered)
            if trace and not any(c.fits for c in candidates):
                for position, found in traced.least_memory(candidates):
                    candidates[position] = found
    except KeyboardInterrupt:
        interrupted = True
    except _OutOfTime:
        out_of_time = True
    return LayoutSearch(
        gpus,
        cluster,
        device_memory,
        global_batch,
        seq_len,
        tuple(candidates),
        time.perf_counter() - started,
        interrupted,
        time_limit=time_limit,
        out_of_time=out_of_time,
        nearest=nearest,
    )


class _OutOfTime(BaseException):
    """Raised in the searching thread when its time limit ends; a ``BaseException``, as
    ``KeyboardInterrupt`` is, so that no ``except Exception`` inside a trace swallows it."""


@contextmanager
def _alarm_after(seconds: float | None) -> Iterator[None]:
    """Raise ``_OutOfTime`` in this (the main) thread once ``seconds`` have passed, wherever it is:
    a trace running here, or the wait on the forked children, whom ``in_forks`` then stops. A
    forked child does not inherit the timer (fork(2))."""
    if seconds is None:
        yield
        return
    if seconds <= 0:
        raise _OutOfTime

    def ring(signum: int, frame: object) -> None:
        raise _OutOfTime

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_RECOMPUTED = {
    ActivationCheckpointing.NONE: 0,
    ActivationCheckpointing.SELECTIVE_OP: 1,
    ActivationCheckpointing.SELECTIVE_LAYER: 1,
    ActivationCheckpointing.FULL: 2,
}


def _likely_fastest_first(candidate: Candidate) -> tuple[int, ...]:
    """The order layouts are traced in, so that a search stopped part way (Ctrl-C, the time limit)
    holds the ones likeliest to rank first: bf16 before fp32, then fewer pipeline stages (less
    bubble), full recomputation last, fewer ranks splitting each sequence (fewer collectives the
    step waits on), the smaller state, and each layout without checkpointing just before its
    selective twin: where the first does not fit, the second often does. It orders the work only:
    every layout is traced either way."""
    layout = candidate.layout
    assert layout is not None
    recomputed = _RECOMPUTED[layout.checkpointing.mode]
    world = layout.world
    full = recomputed == _RECOMPUTED[ActivationCheckpointing.FULL]
    return layout.param_dtype != "bf16", world.pp, full, world.tp * world.cp, candidate.state_bytes or 0, recomputed


def _tracing(candidate: Candidate) -> str:
    assert candidate.layout is not None
    return f"tracing {candidate.layout.text()}"


class _Tracer:
    """Step memory, step collectives and step time of a layout, as ``meshbind check`` runs them."""

    def __init__(self, build: Callable[[], nn.Module], rules: Rules, device_memory: int, device: str, routing: Routing) -> None:
        self.build, self.rules, self.device_memory, self.device, self.routing = build, rules, device_memory, device, routing

    def _settings(self, layout: Layout) -> dict[str, Any]:
        return dict(
            batch=self.rules.local_batch(layout.world),
            seq_len=self.rules.seq_len,
            optimizer=self.rules.optimizer,
            activation_checkpointing=layout.checkpointing,
            device=self.device,
            routing=self.routing,
            pipeline=self.rules.pipeline(layout),
        )

    def full(self, candidate: Candidate) -> Candidate:
        """Traced and, where it fits, priced."""
        return self._traced(candidate, priced=True)

    def _traced(self, candidate: Candidate, *, priced: bool) -> Candidate:
        layout = candidate.layout
        assert layout is not None
        plan = self.rules.plan(layout)
        try:
            settings = dict(device_memory=self.device_memory, **self._settings(layout))
            if priced:
                memory, comms = step_memory_and_comms(self.build, plan, **settings)
                timed = step_time(comms, self.rules.cluster) if memory.fits else None
            else:
                memory, timed = step_memory(self.build, plan, **settings), None
        except (StepMemoryError, ValueError) as error:
            return Candidate(candidate.world, layout, CANNOT_BE_TRACED, str(error), candidate.state_bytes)
        return Candidate(candidate.world, layout, None, None, candidate.state_bytes, memory, timed)

    def least_memory(self, candidates: list[Candidate]) -> Iterator[tuple[int, Candidate]]:
        """When nothing fits: the layouts refused for their state traced in order of that state,
        until the next one's state alone is no less than the smallest peak found; then the smallest
        peak is the least memory any layout needs. Each traced layout comes with its position."""
        peaks = [c.memory.peak_bytes for c in candidates if c.memory is not None]
        least = min(peaks, default=None)
        too_large = [p for p, c in enumerate(candidates) if c.rule == STATE_TOO_LARGE]
        for position in sorted(too_large, key=lambda p: candidates[p].state_bytes or 0):
            state = candidates[position].state_bytes
            assert state is not None
            if least is not None and state >= least:
                return
            found = self._traced(candidates[position], priced=False)
            if found.memory is not None:
                least = found.memory.peak_bytes if least is None else min(least, found.memory.peak_bytes)
            yield position, found
