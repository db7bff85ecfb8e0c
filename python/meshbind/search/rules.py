"""The rules ``meshbind check`` applies to every layout of a search: each world's plan resolved
once, each pipeline split made once, each valid layout's state counted by the report's arithmetic;
the worlds dealt among forked children side by side."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from meshbind.errors import PipelineError, PlanError
from meshbind.forks import dealt, in_forks, usable_cores
from meshbind.fsdp_request import FullyShard
from meshbind.memory.trace import step_size_problem
from meshbind.model_index import ModelIndex
from meshbind.names import DTYPE_NAMES
from meshbind.pipeline import Pipeline, PipelineStages, split_stages
from meshbind.pipeline.schedules import run_orders_side_by_side, schedule_named
from meshbind.pipeline.stages import order_checked
from meshbind.report import plan_report
from meshbind.resolution import ParallelPlan, resolve_plan
from meshbind.resolution.fsdp import mixed_precision_policy
from meshbind.search.result import STATE_TOO_LARGE, Candidate
from meshbind.search.space import REDUCE_DTYPE, Choices, Layout, microbatch_choices, worlds
from meshbind.specs import LayoutContext
from meshbind.steptime.cluster import Cluster
from meshbind.world import World

Progress = Callable[[str, int, int], None]


SHARES_PER_CORE = 4
"""The rules pass deals its worlds into this many shares a core: enough for its progress to move."""


def checked_by_the_rules(rules: Rules, all_worlds: list[World], device_memory: int, progress: Progress | None) -> list[Candidate]:
    """Every candidate of ``all_worlds``, in their order. The pipelines' splits are made here
    first; then the worlds are dealt into shares, each checked in a forked child (a world's
    rules read no other world's). The plans the children resolved are resolved again here for
    the layouts traced."""
    rules.split_every_pipeline(all_worlds, usable_cores())
    shared = dealt(all_worlds, SHARES_PER_CORE * usable_cores())
    checked = 0

    def answered(position: int, share: list[list[Candidate]]) -> None:
        nonlocal checked
        checked += len(share)
        if progress is not None:
            progress("checking the rules", checked, len(all_worlds))

    answers = in_forks(
        lambda share: [list(rules.stated(world, device_memory)) for world in share],
        shared,
        lambda share: f"checking the rules of {len(share)} worlds",
        answered,
    )
    return [c for position in range(len(all_worlds)) for c in answers[position % len(shared)][position // len(shared)]]


def nearest_usable(rules: Rules, gpus: int, expert_parallel: bool, device_memory: int) -> Candidate | None:
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


class Rules:
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
        for world in all_worlds:
            if world.pp > 1 and self._world_refusal(world) is None:
                local = self.local_batch(world)
                for schedule, microbatches in self._pipeline_choices(world):
                    if local % microbatches == 0:
                        self._split(world.pp, schedule, microbatches, check_order=False)
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
        for schedule, microbatches in self._pipeline_choices(world):
            yield schedule, microbatches, self._split_problem(world, schedule, microbatches, local)

    def _pipeline_choices(self, world: World) -> Iterator[tuple[str, int]]:
        for schedule in self.choices.schedules or ():
            stages = world.pp * schedule_named(schedule, "a pipeline schedule").default_stages_per_rank()
            for microbatches in microbatch_choices(self.choices, stages, self.local_batch(world)):
                yield schedule, microbatches

    def _split_problem(self, world: World, schedule: str, microbatches: int, local: int) -> tuple[str, str] | None:
        if local % microbatches:
            return (
                "microbatches over the local batch",
                f"a local batch of {local} does not split into {microbatches} microbatches",
            )
        found = self._split(world.pp, schedule, microbatches)
        return found if isinstance(found, tuple) else None

    def _split(self, pp: int, schedule: str, microbatches: int, check_order: bool = True) -> PipelineStages | tuple[str, str]:
        """The split of ``pp`` stages, made once; without ``check_order`` torch's order waits for
        ``split_every_pipeline`` to make it side by side."""
        key = (pp, schedule, microbatches)
        if key not in self.splits:  # the split reads the model, not the world's other axes
            try:
                pipeline = Pipeline(schedule, microbatches=microbatches)
                self.splits[key] = split_stages(self.index, pp, pipeline, check_order=check_order)
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


def _order_checked_or_refused(split: PipelineStages) -> PipelineStages | tuple[str, str]:
    try:
        return order_checked(split)
    except PipelineError as error:
        return ("pipeline", error.problems[0])


def _checkpointing_problem(layout: Layout) -> tuple[str, str] | None:
    if layout.schedule is None:
        return None
    problem = schedule_named(layout.schedule, "a pipeline schedule").checkpointing_problem(layout.checkpointing)
    return None if problem is None else ("checkpointing under the schedule", problem)


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
