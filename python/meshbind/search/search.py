"""``plan_layouts``: every layout of a cluster checked by the rules ``meshbind check`` applies,
each valid one's state counted by the report's arithmetic, and those whose state fits traced and
priced exactly as ``meshbind check --memory --comms --step-time`` traces and prices them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from meshbind.comms.with_memory import step_memory_and_comms
from meshbind.errors import PipelineError, PlanError, StepMemoryError
from meshbind.forks import in_forks, usable_cores
from meshbind.fsdp_request import FullyShard
from meshbind.memory.trace import step_memory, step_size_problem
from meshbind.model_index import ModelIndex
from meshbind.names import DTYPE_NAMES, ActivationCheckpointing, Optimizer
from meshbind.pipeline import Pipeline, PipelineStages, split_stages
from meshbind.pipeline.schedules import run_orders_side_by_side, schedule_named
from meshbind.pipeline.stages import order_checked
from meshbind.report import plan_report
from meshbind.resolution import ParallelPlan, resolve_plan
from meshbind.resolution.fsdp import mixed_precision_policy
from meshbind.routing import Routing
from meshbind.search.result import CANNOT_BE_TRACED, STATE_TOO_LARGE, Candidate, LayoutSearch
from meshbind.search.space import REDUCE_DTYPE, Choices, Layout, microbatch_choices, worlds
from meshbind.specs import LayoutContext
from meshbind.steptime.cluster import Cluster
from meshbind.steptime.estimate import step_time
from meshbind.world import World

Progress = Callable[[str, int, int], None]


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
) -> LayoutSearch:
    """Every layout of ``gpus`` GPUs for ``model`` (on meta) under ``requests`` (meshbind's
    requests or a plan source such as ``from_hf_plan(model)``), ``global_batch`` sequences of
    ``seq_len`` tokens a step: refused with the rule that refuses it, or traced and priced. Each
    trace runs on a model ``build()`` makes (under ``torch.device("meta")``), as ``step_memory``'s do.

    A layout whose state alone (the report's fullest rank) exceeds ``device_memory`` is not
    traced: its step holds at least that much. Every other valid layout is traced (step memory and
    step collectives from one trace of each step, ``step_memory_and_comms``, as ``meshbind check
    --memory --comms`` traces them) and priced on ``cluster``, so its figures are check's. Ctrl-C
    stops the tracing and returns what was found so far (``interrupted``). Without ``trace``,
    nothing is traced: every candidate is refused by a rule, too large by its state, or valid with
    its state counted (and nothing is ranked)."""
    started = time.perf_counter()
    for name, value in (("gpus", gpus), ("global_batch", global_batch), ("seq_len", seq_len), ("device_memory", device_memory)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, got {type(cluster).__name__}")
    wanted = (choices or Choices()).checked()
    if wanted.expert_parallel is None:
        wanted = replace(wanted, expert_parallel=any(fqn.rpartition(".")[2] == "experts" for fqn, _ in model.named_modules()))
    rules = _Rules(model, requests, wanted, cluster, global_batch, seq_len, optimizer)
    candidates = _checked_by_the_rules(rules, list(worlds(gpus, bool(wanted.expert_parallel))), device_memory, progress)
    passed = any(c.rule in (None, STATE_TOO_LARGE) for c in candidates)
    nearest = None if passed else _nearest_usable(rules, gpus, bool(wanted.expert_parallel), device_memory)
    fitting = [position for position, c in enumerate(candidates) if c.rule is None]
    to_trace = sorted(fitting, key=lambda p: _likely_fastest_first(candidates[p])) if trace else []
    traced = _Tracer(build, rules, device_memory, device, routing or Routing())
    interrupted = False
    done = 0

    def answered(position: int, found: Candidate) -> None:
        nonlocal done
        candidates[to_trace[position]] = found
        done += 1
        if progress is not None:
            progress("tracing layouts", done, len(to_trace))

    try:
        if progress is not None and to_trace:
            progress("tracing layouts", 0, len(to_trace))
        in_forks(traced.full, [candidates[p] for p in to_trace], _tracing, answered)
        if trace and not any(c.fits for c in candidates):
            for position, found in traced.least_memory(candidates):
                candidates[position] = found
    except KeyboardInterrupt:
        interrupted = True
    return LayoutSearch(
        gpus,
        cluster,
        device_memory,
        global_batch,
        seq_len,
        tuple(candidates),
        time.perf_counter() - started,
        interrupted,
        nearest=nearest,
    )


SHARES_PER_CORE = 4
"""The rules pass deals its worlds into this many shares a core: enough for its progress to move."""


def _checked_by_the_rules(
    rules: _Rules, all_worlds: list[World], device_memory: int, progress: Progress | None
) -> list[Candidate]:
    """Every candidate of ``all_worlds``, in their order. The pipelines' splits are made here
    first; then the worlds are dealt into shares, each checked in a forked child (a world's
    rules read no other world's). The plans the children resolved are resolved again here for
    the layouts traced."""
    rules.split_every_pipeline(all_worlds, usable_cores())
    shares = max(1, min(SHARES_PER_CORE * usable_cores(), len(all_worlds)))
    dealt = [all_worlds[share::shares] for share in range(shares)]
    checked = 0

    def answered(position: int, share: list[list[Candidate]]) -> None:
        nonlocal checked
        checked += len(share)
        if progress is not None:
            progress("checking the rules", checked, len(all_worlds))

    answers = in_forks(
        lambda share: [list(rules.stated(world, device_memory)) for world in share],
        dealt,
        lambda share: f"checking the rules of {len(share)} worlds",
        answered,
    )
    return [c for position in range(len(all_worlds)) for c in answers[position % shares][position // shares]]


def _nearest_usable(rules: _Rules, gpus: int, expert_parallel: bool, device_memory: int) -> Candidate | None:
    """Where no layout of ``gpus`` GPUs passes the rules: a layout of the nearest GPU count (the
    smaller of two as near) that passes them and whose state fits, by the rules alone (nothing
    traced); ``None`` when no count up to twice ``gpus`` has one."""
    for distance in range(1, gpus + 1):
        for count in (gpus - distance, gpus + distance):
            for world in worlds(count, expert_parallel) if count >= 1 else ():
                usable = next((c for c in rules.stated(world, device_memory) if c.rule is None), None)
                if usable is not None:
                    return usable
    return None


class _Rules:
    """The rules ``meshbind check`` applies to a layout: each plan resolved once per world, each
    split made once per pipeline (``pp``, schedule, microbatches) and each state counted once per
    world and stage count."""

    def __init__(
        self, model: nn.Module, requests: Any, choices: Choices, cluster: Cluster, global_batch: int, seq_len: int, optimizer: str
    ) -> None:
        self.model, self.requests, self.choices, self.cluster = model, requests, choices, cluster
        self.index = ModelIndex.of(model)
        self.global_batch, self.seq_len, self.optimizer = global_batch, seq_len, optimizer
        self.resolved: dict[World, ParallelPlan | tuple[str, str]] = {}
        self.plans: dict[tuple[World, str], ParallelPlan] = {}
        self.splits: dict[tuple[int, str, int], PipelineStages | tuple[str, str]] = {}
        self.ordered = True
        """Whether a split made now checks torch's schedule order at once (``split_every_pipeline`` defers it)."""
        self.states: dict[tuple[World, int], int] = {}

    def local_batch(self, world: World) -> int:
        return self.global_batch // (world.dp_replicate * world.dp_shard)

    def layouts(self, world: World) -> Iterator[Candidate]:
        """The world refused as a whole, or each of its layouts, valid or refused."""
        refusal = self._world_refusal(world)
        if refusal is not None:
            yield Candidate(world, None, *refusal)
            return
        for dtype in self.choices.param_dtypes or ():
            plan = self._plan(world, dtype)
            if isinstance(plan, tuple):
                yield Candidate(world, None, *plan)
                continue
            for schedule, microbatches, problem in self._pipelines(world):
                for checkpointing in self.choices.checkpointing or ():
                    layout = Layout(world, schedule, microbatches, checkpointing, dtype)  # type: ignore[arg-type]
                    yield Candidate(world, layout, *(problem or _checkpointing_problem(layout) or (None, None)))

    def stated(self, world: World, device_memory: int) -> Iterator[Candidate]:
        """Each of ``world``'s candidates, a valid one with its state counted: too large for
        ``device_memory`` by its state alone, or left valid to trace."""
        for candidate in self.layouts(world):
            if candidate.rule is None and candidate.layout is not None:
                state = self.state_bytes(candidate.layout)
                candidate = replace(candidate, rule=STATE_TOO_LARGE if state > device_memory else None, state_bytes=state)
            yield candidate

    def _world_refusal(self, world: World) -> tuple[str, str] | None:
        tp, node = world.tp, self.cluster.gpus_per_node
        if tp > node or node % tp:
            return "tp within a node", f"tp={tp} does not fit within a node of {node} GPUs: its collectives would leave NVLink"
        data_parallel = world.dp_replicate * world.dp_shard
        if self.global_batch % data_parallel:
            return (
                "global batch over data-parallel ranks",
                f"global batch {self.global_batch} does not split over dp_replicate · dp_shard = {data_parallel} ranks",
            )
        problem = step_size_problem(self.local_batch(world), self.seq_len)
        if problem is not None:
            return "step size", problem
        return None

    def _plan(self, world: World, dtype: str) -> ParallelPlan | tuple[str, str]:
        """The world's plan at ``dtype``, or why it is refused. Resolved once per world: neither
        its problems nor its units depend on the precision, only the units' policy does."""
        if world not in self.resolved:
            try:
                context = LayoutContext(world.axis_sizes())
                plan = resolve_plan(self.model, self.requests, context, fully_shard=_units(dtype), index=True)
                self.resolved[world] = _idle_axis(plan, world) or plan
            except PlanError as error:
                first = error.problems[0]
                self.resolved[world] = (f"plan: {first.code}", first.line())
        resolved = self.resolved[world]
        if isinstance(resolved, tuple):
            return resolved
        key = (world, dtype)
        if key not in self.plans:
            assert resolved.fsdp is not None
            self.plans[key] = replace(resolved, fsdp=resolved.fsdp.with_policy(mixed_precision_policy(_units(dtype))))
        return self.plans[key]

    def split_every_pipeline(self, all_worlds: list[World], shares: int) -> None:
        """Every split the worlds' layouts ask for, made once, before the worlds are dealt out:
        first without torch's schedule orders, then the orders of those made (the slow part) in
        ``shares`` forked children side by side, then each split's order checked."""
        self.ordered = False
        try:
            for world in all_worlds:
                if self._world_refusal(world) is None:
                    for _ in self._pipelines(world):
                        pass
        finally:
            self.ordered = True
        made = [split for split in self.splits.values() if isinstance(split, PipelineStages)]
        run_orders_side_by_side(((s.schedule, s.pp, len(s.stages), s.microbatches) for s in made), shares)
        for key, split in self.splits.items():
            if isinstance(split, PipelineStages):
                self.splits[key] = _order_checked_or_refused(split)

    def _pipelines(self, world: World) -> Iterator[tuple[str | None, int | None, tuple[str, str] | None]]:
        """Each schedule and microbatch count under ``pp`` above 1, with the problem that refuses it."""
        if world.pp == 1:
            yield None, None, None
            return
        local = self.local_batch(world)
        for schedule in self.choices.schedules or ():
            stages = world.pp * (1 if schedule in ("GPipe", "1F1B") else 2)
            for microbatches in microbatch_choices(self.choices, stages, local):
                yield schedule, microbatches, self._split_problem(world, schedule, microbatches, local)

    def _split_problem(self, world: World, schedule: str, microbatches: int, local: int) -> tuple[str, str] | None:
        if local % microbatches:
            return (
                "microbatches over the local batch",
                f"a local batch of {local} does not split into {microbatches} microbatches",
            )
        found = self._split(world.pp, schedule, microbatches)
        return found if isinstance(found, tuple) else None

    def _split(self, pp: int, schedule: str, microbatches: int) -> PipelineStages | tuple[str, str]:
        key = (pp, schedule, microbatches)
        if key not in self.splits:  # the split reads the model, not the world's other axes
            try:
                pipeline = Pipeline(schedule, microbatches=microbatches)
                self.splits[key] = split_stages(self.index, pp, pipeline, check_order=self.ordered)
            except PipelineError as error:
                self.splits[key] = ("pipeline", error.problems[0])
        return self.splits[key]

    def plan(self, layout: Layout) -> ParallelPlan:
        """A valid layout's plan (resolved here if a forked child checked its world)."""
        plan = self._plan(layout.world, layout.param_dtype)
        assert not isinstance(plan, tuple)
        return plan

    def stages(self, layout: Layout) -> PipelineStages | None:
        if layout.schedule is None or layout.microbatches is None:
            return None
        split = self._split(layout.world.pp, layout.schedule, layout.microbatches)
        assert not isinstance(split, tuple)  # a valid layout's split
        return split

    def pipeline(self, layout: Layout) -> Pipeline | None:
        return None if layout.schedule is None else Pipeline(layout.schedule, microbatches=layout.microbatches)

    def state_bytes(self, layout: Layout) -> int:
        """The report's fullest rank: parameters, gradients and optimizer state (the stages' split
        does not depend on the microbatches, and the state not on the units' precision: FSDP2
        keeps the sharded parameters, their gradients and the optimizer's in the parameters' dtype)."""
        stages = self.stages(layout)
        key = (layout.world, 0 if stages is None else len(stages.stages))
        if key not in self.states:
            report = plan_report(self.model, self.plan(layout), optimizer=self.optimizer, pipeline=stages)
            self.states[key] = report.totals()["total_bytes_per_rank"]
        return self.states[key]


_RECOMPUTED = {
    ActivationCheckpointing.NONE: 0,
    ActivationCheckpointing.SELECTIVE_OP: 1,
    ActivationCheckpointing.SELECTIVE_LAYER: 1,
    ActivationCheckpointing.FULL: 2,
}


def _order_checked_or_refused(split: PipelineStages) -> PipelineStages | tuple[str, str]:
    try:
        return order_checked(split)
    except PipelineError as error:
        return ("pipeline", error.problems[0])


def _likely_fastest_first(candidate: Candidate) -> tuple[int, ...]:
    """The order layouts are traced in, so that a search stopped part way (Ctrl-C) holds the ones
    likeliest to rank first: bf16 before fp32, then fewer pipeline stages (less bubble), less
    recomputation, fewer ranks splitting each sequence (fewer collectives the step waits on), and
    the smaller state. It orders the work only: every layout is traced either way."""
    layout = candidate.layout
    assert layout is not None
    recomputed = _RECOMPUTED[layout.checkpointing.mode]
    world = layout.world
    return layout.param_dtype != "bf16", world.pp, recomputed, world.tp * world.cp, candidate.state_bytes or 0


def _checkpointing_problem(layout: Layout) -> tuple[str, str] | None:
    if layout.schedule is None:
        return None
    problem = schedule_named(layout.schedule, "a pipeline schedule").checkpointing_problem(layout.checkpointing)
    return None if problem is None else ("checkpointing under the schedule", problem)


def _tracing(candidate: Candidate) -> str:
    assert candidate.layout is not None
    return f"tracing {candidate.layout.text()}"


def _units(dtype: str) -> FullyShard:
    """torchtitan's default FSDP units, computing in ``dtype`` and reducing in float32."""
    return FullyShard(None, param_dtype=_dtype(dtype), reduce_dtype=_dtype(REDUCE_DTYPE))


def _dtype(name: str) -> torch.dtype:
    dtype: torch.dtype = getattr(torch, DTYPE_NAMES[name])
    return dtype


def _idle_axis(plan: ParallelPlan, world: World) -> tuple[str, str] | None:
    """An axis above 1 that the plan splits nothing over only repeats the work on its ranks:
    ``check`` accepts such a world, a search leaves it out."""
    placed = {axis for spec in plan.sharding.values() for placements in spec.params.values() for axis in placements}
    bound = {spec.binding_kind for spec in plan.parallel_modules.values()}
    for axis, used in (("tp", "tp" in placed), ("cp", "cp" in bound), ("ep", "ep" in placed)):
        size = world.size_of(axis)
        if size > 1 and not used:
            return (
                f"{axis} splits nothing",
                f"{axis}={size}: the plan splits nothing over {axis}, so its ranks would repeat the work",
            )
    return None


class _Tracer:
    """Step memory, step collectives and step time of a layout, as ``meshbind check`` runs them."""

    def __init__(self, build: Callable[[], nn.Module], rules: _Rules, device_memory: int, device: str, routing: Routing) -> None:
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
