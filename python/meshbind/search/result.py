"""What a layout search found: every candidate, valid or why not, each valid one's peak memory,
whether it fits, and its step time; ranked by tokens per second per GPU."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from meshbind.memory.result import StepMemory
from meshbind.search.space import Layout
from meshbind.steptime.cluster import Cluster
from meshbind.steptime.result import StepTime
from meshbind.units import size_text
from meshbind.world import World


@dataclass(frozen=True)
class Candidate:
    """One world, or one layout of it, and what the search found of it: refused (``rule`` names
    the rule, ``detail`` the problem as ``meshbind check`` words it), too large by its state
    alone (``state_bytes``: the report's fullest rank, which every step holds at its optimizer
    step), or traced (``memory``, and ``time`` where it was priced)."""

    world: World
    layout: Layout | None = None
    """``None`` where the world itself is refused, whatever else is chosen."""
    rule: str | None = None
    detail: str | None = None
    state_bytes: int | None = None
    memory: StepMemory | None = None
    time: StepTime | None = None

    @property
    def fits(self) -> bool | None:
        """Whether the step fits the device (``None``: not known, refused or not traced)."""
        if self.memory is not None:
            return self.memory.fits
        return False if self.rule == STATE_TOO_LARGE else None

    @property
    def ranked(self) -> bool:
        return self.time is not None and self.fits is True

    def to_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = self.layout.to_dict() if self.layout is not None else {"axes": self.world.axis_sizes()}
        found |= {"refused": self.rule, "detail": self.detail, "fits": self.fits, "state_bytes": self.state_bytes}
        if self.memory is not None:
            found |= {"peak_bytes": self.memory.peak_bytes, "memory": self.memory.to_dict()}
        if self.time is not None:
            found |= {
                "step_s": self.time.step,
                "tokens_per_second_per_gpu": self.time.tokens_per_second_per_gpu,
                "mfu": self.time.mfu,
                "step_time": self.time.to_dict(),
            }
        return found


STATE_TOO_LARGE = "does not fit: state alone"
"""The rule of a layout whose parameters, gradients and optimizer state alone exceed the device."""
PEAK_TOO_LARGE = "does not fit: traced peak"
CANNOT_BE_TRACED = "cannot be traced"
"""The rule of a valid layout whose step trace raised (its ``detail`` says why)."""


@dataclass(frozen=True)
class LayoutSearch:
    """``plan_layouts``' answer: every candidate, the best first."""

    gpus: int
    cluster: Cluster
    device_memory: int
    global_batch: int
    seq_len: int
    candidates: tuple[Candidate, ...]
    seconds: float
    interrupted: bool = False
    """Stopped by Ctrl-C: the candidates traced by then, the rest not yet."""
    time_limit: float | None = None
    """The seconds the whole search was given (``None``: no limit)."""
    out_of_time: bool = False
    """The time limit stopped the tracing: the candidates traced by then, the rest not yet."""
    commands: tuple[str, ...] = field(default=(), compare=False)
    """``meshbind check`` for each ranked candidate, in rank order (empty from Python)."""
    nearest: Candidate | None = None
    """Where no layout of ``gpus`` passes the rules: one of the nearest GPU count that does and
    whose state fits (``None`` otherwise)."""

    @cached_property
    def ranked(self) -> list[Candidate]:
        """The layouts that fit, fastest first (tokens per second per GPU); sorted once."""
        fitting = [c for c in self.candidates if c.ranked]
        return sorted(fitting, key=lambda c: -c.time.tokens_per_second_per_gpu)  # type: ignore[union-attr]

    def front(self) -> list[Candidate]:
        """The ranked layouts no other beats on both counts: none that fits needs less memory and
        runs at least as fast, or as little memory and runs faster (of two with the same figures,
        the one ranked first stands for both). Least memory first."""
        front: list[Candidate] = []
        # Ascending peak, the fastest first among equal peaks: a layout is on the front when it is
        # faster than every one before it.
        for candidate in sorted(self.ranked, key=lambda c: (c.memory.peak_bytes, -c.time.tokens_per_second_per_gpu)):  # type: ignore[union-attr]
            assert candidate.time is not None
            if not front or candidate.time.tokens_per_second_per_gpu > front[-1].time.tokens_per_second_per_gpu:  # type: ignore[union-attr]
                front.append(candidate)
        return front

    def refusals(self) -> Counter[str]:
        """How many candidates each rule refused, and how many did not fit."""
        counts: Counter[str] = Counter()
        for candidate in self.candidates:
            if candidate.rule is not None:
                counts[candidate.rule] += 1
            elif candidate.memory is not None and candidate.fits is False:
                counts[PEAK_TOO_LARGE] += 1
        return counts

    def untraced(self) -> int:
        """Valid layouts whose state fits that a stopped search did not trace."""
        return sum(1 for c in self.candidates if c.rule is None and c.memory is None)

    def least_memory(self) -> Candidate | None:
        """The traced layout with the smallest peak: what the device would need, when nothing fits."""
        traced = [c for c in self.candidates if c.memory is not None]
        return min(traced, key=lambda c: c.memory.peak_bytes, default=None)  # type: ignore[union-attr]

    def to_dict(self) -> dict[str, Any]:
        # Positions by identity: a candidate's equality compares its whole trace.
        position = {id(c): n for n, c in enumerate(self.candidates)}
        return {
            "gpus": self.gpus,
            "cluster": self.cluster.to_dict(),
            "device_memory": self.device_memory,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "seconds": self.seconds,
            "interrupted": self.interrupted,
            "time_limit": self.time_limit,
            "out_of_time": self.out_of_time,
            "untraced": self.untraced(),
            "ranked": [position[id(c)] for c in self.ranked],
            "front": [position[id(c)] for c in self.front()],
            "commands": list(self.commands),
            "refusals": dict(self.refusals()),
            "nearest": None if self.nearest is None else self.nearest.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def heading(self) -> str:
        """The cluster, the work and how many layouts fit, in a line."""
        return (
            f"{self.gpus:,} x {self.cluster.gpu.name} ({size_text(self.device_memory)} each), global batch {self.global_batch} "
            f"x seq {self.seq_len}: {len(self.candidates):,} candidates, {len(self.ranked):,} fit" + self._stopped()
        )

    def _stopped(self) -> str:
        """Why a search stopped before tracing every layout, and how far it got."""
        if not (self.interrupted or self.out_of_time):
            return ""
        why = "interrupted" if self.interrupted else f"stopped by the {self.time_limit:g} s time limit"
        return f" ({why}: {self.untraced():,} left untraced; the best found so far)"

    def text(self, top: int = 10) -> str:
        ranked = self.ranked
        lines = [self.heading()]
        if ranked:
            lines.append(f"  {'#':>3}  {'tokens/s/GPU':>12}  {'MFU':>6}  {'step':>9}  {'peak':>10}  layout")
            for number, candidate in enumerate(ranked[:top], 1):
                timed, memory = candidate.time, candidate.memory
                assert timed is not None and memory is not None and candidate.layout is not None
                mfu = f"{timed.mfu:.1%}" if timed.mfu is not None else "?"
                lines.append(
                    f"  {number:>3}  {timed.tokens_per_second_per_gpu:>12,.0f}  {mfu:>6}  {timed.step * 1e3:>7.2f}ms  "
                    f"{size_text(memory.peak_bytes):>10}  {candidate.layout.text()}"
                )
            if self.commands:
                lines.append("check each with:")
                lines += [f"  {number}: {command}" for number, command in enumerate(self.commands[:top], 1)]
        refusals = self.refusals()
        if refusals:
            lines.append("left out:")
            for rule, count in refusals.most_common():
                lines.append(f"  {count:>6,}  {rule}{self._nearest(rule)}{self._example(rule)}")
        return "\n".join(lines)

    def _example(self, rule: str) -> str:
        """One refused candidate of ``rule`` and the problem as check words it."""
        first = next((c for c in self.candidates if c.rule == rule and c.detail is not None), None)
        if first is None:
            return ""
        where = (
            first.layout.text()
            if first.layout is not None
            else " · ".join(f"{axis} {size}" for axis, size in first.world.axis_sizes().items() if size > 1)
        )
        return f"\n            e.g. {where}: {first.detail}"

    def _nearest(self, rule: str) -> str:
        """For the layouts too large, the one closest to fitting and by how much."""
        if rule == PEAK_TOO_LARGE:
            sized = [(c.memory.peak_bytes, c) for c in self.candidates if c.memory is not None and c.fits is False]
        elif rule == STATE_TOO_LARGE:
            sized = [(c.state_bytes, c) for c in self.candidates if c.rule == rule and c.state_bytes is not None]
        else:
            return ""
        least, closest = min(sized, key=lambda pair: pair[0])
        over = size_text(least - self.device_memory)
        assert closest.layout is not None
        return f" (closest: {closest.layout.text()}, {over} over)"
