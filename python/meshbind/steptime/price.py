"""A traced stretch of a step priced on a cluster: each operator by the roofline of the GPU's
peaks, each collective by nccl-tests' bus bandwidth, and the two run side by side as the step
runs them.

The compute stream runs the operators in the traced order. A collective the step waits on (TP's,
CP's, EP's all-to-all: the next operator reads its result) holds the stream until it ends. FSDP's
run on streams of their own, one at a time: a unit's all-gather may start once the unit gathered
before it is taken by the computation (FSDP2 keeps one all-gather ahead, in forward as the CPU runs
ahead, in backward by prefetching), and the operator that first reads its output waits for it; a
reduce-scatter (and HSDP's all-reduce) starts when the unit's gradients are made, and only the
optimizer (or the end of a pipeline's schedule) waits for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshbind.comms.timeline import OPTIMIZER, SCHEDULE_END, Compute, Event, Transfer
from meshbind.steptime.cluster import Cluster, Gpu

P2P_KINDS = ("send", "receive")


def bus_factor(kind: str, group_size: int) -> float:
    """nccl-tests' bus bandwidth over its algorithm bandwidth (its PERFORMANCE.md): a collective of
    ``size`` bytes takes ``size · factor / bandwidth``."""
    n = group_size
    if kind == "all-reduce":
        return 2 * (n - 1) / n
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n
    return 1.0  # broadcast, send, receive


def transfer_seconds(transfer: Transfer, cluster: Cluster) -> float:
    if transfer.group_size <= 1:
        return 0.0
    factor = bus_factor(transfer.kind, transfer.group_size)
    return transfer.bytes * factor / cluster.link_bandwidth(transfer.lowest_rank, transfer.highest_rank)


def compute_seconds(compute: Compute, gpu: Gpu) -> float:
    """The roofline: the longer of the arithmetic at the GPU's dense peak for the operator's
    precision and the bytes at its memory bandwidth."""
    peak = gpu.half_flops if compute.half else gpu.single_flops
    return max(compute.flops / peak, compute.bytes / gpu.memory_bandwidth)


@dataclass
class Spent:
    """Seconds of a stretch of the step on the compute stream: its own operators, the waits on
    collectives by their group's axes (``dp_shard·cp``), and how long collectives ran beside it."""

    compute: float = 0.0
    exposed: dict[str, float] = field(default_factory=dict)
    beside: float = 0.0
    beside_waited: float = 0.0
    still_running: float = 0.0
    """Seconds collectives beside the computation ran on after it (nothing waited for them here)."""
    still_running_axes: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return self.compute + sum(self.exposed.values())

    def add(self, other: Spent, times: float = 1.0) -> None:
        self.compute += times * other.compute
        self.beside += times * other.beside
        self.beside_waited += times * other.beside_waited
        for axes, seconds in other.exposed.items():
            self.exposed[axes] = self.exposed.get(axes, 0.0) + times * seconds

    @property
    def hidden(self) -> float:
        """Collectives' time beside the computation that it did not wait on."""
        return max(0.0, self.beside - self.beside_waited)

    def waited(self, axes: tuple[str, ...], seconds: float, beside: bool = False) -> None:
        if seconds > 0:
            name = "·".join(axes)
            self.exposed[name] = self.exposed.get(name, 0.0) + seconds
            self.beside_waited += seconds if beside else 0.0


def priced(events: Sequence[Event], cluster: Cluster, settled: bool = True) -> Spent:
    """``events`` (a stretch without pipeline sends and receives, which the schedule prices) on
    ``cluster``: see the module's note. Unless ``settled``, the stretch ends with its computation
    and what still runs beside it is left ``still_running`` (a pipeline action: the next action
    goes on while FSDP reduces the gradients)."""
    spent = Spent()
    now = 0.0  # the compute stream's clock
    beside_free = 0.0  # when the collective running beside the computation ends
    beside_axes: tuple[str, ...] = ()
    consumed = 0.0  # when the computation last took a gathered unit: the next all-gather's buffer is free
    ends: dict[int, tuple[float, tuple[str, ...]]] = {}
    for event in events:
        if isinstance(event, Compute):
            if event.waits_for in ends:
                end, axes = ends.pop(event.waits_for)
                spent.waited(axes, end - now, beside=True)
                now = consumed = max(now, end)
            seconds = compute_seconds(event, cluster.gpu)
            spent.compute += seconds
            now += seconds
        elif isinstance(event, Transfer):
            if event.kind in P2P_KINDS:
                continue
            seconds = transfer_seconds(event, cluster)
            if not event.beside_compute:
                spent.waited(event.axes, seconds)
                now += seconds
                continue
            spent.beside += seconds
            start = max(beside_free, consumed if event.kind == "all-gather" else now)
            beside_free, beside_axes = start + seconds, event.axes
            if event.kind == "all-gather":
                ends[event.gather] = (beside_free, event.axes)
        elif event.what in (OPTIMIZER, SCHEDULE_END):  # every gradient must be reduced
            spent.waited(beside_axes, beside_free - now, beside=True)
            now = max(now, beside_free)
    if settled:
        spent.waited(beside_axes, beside_free - now, beside=True)
    else:
        spent.still_running, spent.still_running_axes = max(0.0, beside_free - now), beside_axes
    return spent


def extrapolated(at_depths: list[Spent], depths: tuple[int, ...], full_depth: int) -> Spent | None:
    """The stretch at ``full_depth`` alike blocks from the stretches traced at ``depths`` (one
    apart), or ``None`` where they do not grow by equal steps (the overlap changes with depth)."""
    first, second, third = at_depths
    step, next_step = Spent(), Spent()
    step.add(second)
    step.add(first, -1.0)
    next_step.add(third)
    next_step.add(second, -1.0)
    figures = [(step.compute, next_step.compute), (step.beside, next_step.beside), (step.beside_waited, next_step.beside_waited)]
    figures += [(step.exposed.get(axes, 0.0), next_step.exposed.get(axes, 0.0)) for axes in {*step.exposed, *next_step.exposed}]
    scale = max(third.total, third.beside, 1e-30)
    if any(abs(a - b) > 1e-9 * scale for a, b in figures):
        return None
    full = Spent()
    full.add(first)
    full.add(step, full_depth - depths[0])
    full.exposed = {axes: seconds for axes, seconds in full.exposed.items() if seconds > 1e-12 * scale}
    return full
