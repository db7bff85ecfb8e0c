"""Step memory and step collectives from the same traced steps, for a caller that asks both
(``meshbind plan``, ``meshbind check --memory --comms``): each fake step runs once, under torch's
memory trackers and the collective record together, where ``step_memory`` and ``step_comms`` each
run it. Each answer is the one its own function gives: the same steps, each watched the same way
(the record only reads the ops the trackers count), extrapolated over alike blocks by the same
rules, and under a pipeline the same ranks put together from a traced rank's actions (where a
single-stage schedule traces every microbatch each rank is traced: its microbatches in flight are
its own)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from torch import nn

from meshbind.comms.composed import TracedRank
from meshbind.comms.result import RankClassComms, StepComms
from meshbind.comms.trace import CommsWatch, PipelinedCommsWatch, extrapolated_class, pipelined_class_comms, whole_class
from meshbind.comms.trace import put_together_class as put_together_comms
from meshbind.forks import in_forks
from meshbind.memory.depth import TRACED_DEPTHS
from meshbind.memory.fake_step import watched_by
from meshbind.memory.pipelined import PipelinedMemoryWatch, PipelinedStep, pipelined_step, run_pipelined_fake_step
from meshbind.memory.result import RankClassMemory, StepMemory
from meshbind.memory.step import StepInputs
from meshbind.memory.trace import (
    MemoryWatch,
    TracedModels,
    class_memory,
    pipelined_class_memory,
    traced_step_settings,
    tracing_text,
)
from meshbind.memory.trace import (
    extrapolated_class as extrapolated_memory,
)
from meshbind.memory.trace import (
    put_together_class as put_together_memory,
)
from meshbind.memory.trackers import StepPart
from meshbind.model_flops import model_flops_per_token
from meshbind.names import ActivationCheckpointing, Checkpointing, Device, Optimizer
from meshbind.pipeline import Pipeline
from meshbind.pipeline.runtime import Orders, traced_and_put_together
from meshbind.report import RankGroup, plan_report
from meshbind.resolution.plan import ParallelPlan
from meshbind.routing import Routing

Answers = tuple[RankClassMemory, RankClassComms]


def step_memory_and_comms(
    build: Callable[[], nn.Module],
    plan: ParallelPlan,
    *,
    batch: int,
    seq_len: int,
    optimizer: str = Optimizer.ADAM,
    activation_checkpointing: str | Checkpointing = ActivationCheckpointing.NONE,
    device: str = Device.CUDA,
    device_memory: int | None = None,
    routing: Routing | None = None,
    inputs: StepInputs | None = None,
    pipeline: Pipeline | None = None,
    alike_layers: bool = True,
) -> tuple[StepMemory, StepComms]:
    """``step_memory(...)`` and ``step_comms(...)`` of the same arguments from one trace of each
    step (the arguments are theirs); each answer's ``seconds`` is the time both took."""
    settings, comms_settings = (
        traced_step_settings(
            traced_by,
            plan,
            batch=batch,
            seq_len=seq_len,
            optimizer=optimizer,
            activation_checkpointing=activation_checkpointing,
            device=device,
            device_memory=memory,
            routing=routing,
        )
        for traced_by, memory in (("step_memory", device_memory), ("step_comms", None))
    )
    started = time.perf_counter()
    world = plan.context.world
    models = TracedModels(build, plan, alike_layers and world.pp == 1)
    flops_per_token = model_flops_per_token(models.first(), seq_len)
    if world.pp == 1:
        if pipeline is not None:
            raise ValueError("pipeline is for a plan with pp above 1; this plan has pp=1")
        groups = plan_report(models.index, plan, optimizer="none").rank_groups

        def traced(group: RankGroup) -> Answers:
            class_started = time.perf_counter()
            memory: RankClassMemory | None = None
            comms: RankClassComms | None = None
            if (run := models.run) is not None:
                memory_watches = [MemoryWatch(run.list_fqn) for _ in TRACED_DEPTHS]
                comms_watches = [CommsWatch(world) for _ in TRACED_DEPTHS]
                watches = [watched_by(*both) for both in zip(memory_watches, comms_watches, strict=True)]
                models.at_depths(plan, group.first, settings, inputs, watches)
                memory = extrapolated_memory(group, [watch.peak() for watch in memory_watches], run, class_started)
                comms = extrapolated_class(group, [watch.record for watch in comms_watches], run, class_started)
            if memory is None or comms is None:
                memory_watch, comms_watch = MemoryWatch(models.index.layer_list()), CommsWatch(world)
                models.at_full_depth(plan, group.first, settings, inputs, watched_by(memory_watch, comms_watch))
                memory = memory or class_memory(group, memory_watch.peak(), "the whole model", class_started)
                comms = comms or whole_class(group, comms_watch.record, "the whole model", class_started)
            return memory, comms

        answers = in_forks(traced, groups, tracing_text)
    else:
        whole = models.first()
        step = pipelined_step(whole, replace(plan, index=models.index), settings, pipeline, inputs)
        settings, comms_settings = step.settings, replace(comms_settings, pipeline=step.settings.pipeline)

        answers = _pipelined_answers(whole, step, alike_layers)
    seconds = time.perf_counter() - started
    memory_classes = tuple(memory for memory, _ in answers)
    comms_classes = tuple(comms for _, comms in answers)
    return (
        StepMemory(settings, world, memory_classes, seconds),
        StepComms(comms_settings, world, comms_classes, seconds, flops_per_token),
    )


def _pipelined_answers(whole: nn.Module, step: PipelinedStep, alike_layers: bool) -> list[Answers]:
    """Each rank class's answers under the pipeline, in the groups' order. With ``alike_layers``,
    the ranks both functions put together from a traced rank's actions are put together here from
    the same traces (both pick the ranks to trace, and the microbatches to trace them at, by the
    same twins: ``PipelinedStep.actions_to_put_together``); else every class is traced (where a
    single-stage schedule traces every microbatch step memory traces each rank, whose microbatches
    in flight differ)."""
    world, places = step.plan.context.world, step.places()
    actions = step.actions_to_put_together() if alike_layers else None
    traced_step = step.traced_step(actions)
    cut: dict[int, TracedRank] = {}

    def trace(position: int) -> tuple[tuple[Answers, list[StepPart]], Orders | None]:
        started, group = time.perf_counter(), step.groups[position]
        memory_watch, comms_watch = PipelinedMemoryWatch(step.plan), PipelinedCommsWatch(world)
        watch = watched_by(memory_watch, comms_watch)
        run_pipelined_fake_step(whole, step.plan, traced_step.stages, step.examples, group.first, traced_step.settings, watch)
        memory = pipelined_class_memory(step, group, memory_watch.peak(), started)
        answers = memory, pipelined_class_comms(step, group, comms_watch.record, started)
        return (answers, memory_watch.parts()), comms_watch.orders

    def answer(position: int, source: int, taken: list[int] | None, traced: tuple[Answers, list[StepPart]]) -> Answers:
        (answers, parts), group = traced, step.groups[position]
        if taken is None:
            return answers
        assert actions is not None
        source_cut = cut.setdefault(source, TracedRank.cut(places[source][0], answers[1].work.timelines[0], actions))
        memory = put_together_memory(step, group, step.groups[source], parts, taken, actions)
        return memory, put_together_comms(step, group, source_cut, taken, actions)

    return traced_and_put_together(places, actions, trace, answer, lambda position: tracing_text(step.groups[position]))
