"""One pipelined training step of one rank, traced: the rank's stages cut from the whole model on
``meta`` and the plan applied to each as a training job applies it, then torch's own
``PipelineStage``s and schedule run over fake tensors and torch's fake process group (a send
moves nothing, a receive allocates its buffer as in a real step), and the optimizer step.

The microbatches in flight at each moment are torch's own: its schedule runs every action of this
rank in its order, so a stage holds each microbatch's activations from its forward to its
backward, FSDP keeps what it keeps between microbatches (gathered parameters, unsharded gradients
until the last backward reduces them), and receive buffers live as torch allocates them. The
trackers count the step as a whole; each stage's root runs forward once per microbatch.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.pipelining.schedules import _PipelineSchedule

from meshbind.errors import StepMemoryError
from meshbind.memory.attention import CudaAttention, real_step_masks
from meshbind.memory.fake_world import fake_world, without_torch_advice
from meshbind.memory.fsdp_chunks import chunks_for_traced_rank
from meshbind.memory.result import StepSettings
from meshbind.memory.step import apply_plan, make_optimizer, make_optimizer_state, pipelined_training_step
from meshbind.memory.trackers import TRACED_DEVICE, Peak, StepPart, step_tracker, traced_step
from meshbind.mesh import MeshContext
from meshbind.names import Device
from meshbind.pipeline import (
    Pipeline,
    PipelineStages,
    StagePart,
    pipeline_schedule,
    runnable_stage,
    split_stages,
    stage_loss,
    stage_model,
)
from meshbind.pipeline.alike import stage_signatures
from meshbind.pipeline.hooks import actions_run, on_each_action, on_each_runtime_step, stages_of
from meshbind.pipeline.runtime import (
    Orders,
    RankActions,
    action_parts,
    lowered_orders,
    single_stage_orders,
    with_fewer_microbatches,
)
from meshbind.report import RankGroup, plan_report
from meshbind.resolution.plan import ParallelPlan
from meshbind.routing import Routing, assuming
from meshbind.world import PIPELINE_AXIS

Examples = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""Each stage's microbatch input and output, on ``meta``."""


def stage_examples(
    whole: nn.Module, stages: PipelineStages, signatures: Sequence[object], microbatch: int, seq_len: int, routing: Routing
) -> Examples:
    """Each stage's input and output for one microbatch of ``microbatch`` sequences: the stages run
    in turn on fake tensors, without the plan (a stage hands on whole tensors, as its layouts
    hand them on), each output the next stage's input. torch learns these in a real step by
    sending them between the stages, which a fake group cannot. A stage alike an earlier one
    (``signatures``: the same modules), given the same input, hands on what that one did: it is not run."""
    examples: Examples = {}
    count = len(stages.stages)
    ran: dict[tuple[object, ...], Any] = {}
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    given = torch.zeros(microbatch, seq_len, dtype=torch.long)
    for stage in range(count):
        alike = (signatures[stage], stage == 0, stage == count - 1, given.shape, given.dtype)
        if (output := ran.get(alike)) is None:
            model = runnable_stage(stage_model(whole, stages.keeps(stage)), stage, count)  # copied outside the fake mode
            with fake, assuming(routing), real_step_masks():
                model.to_empty(device=TRACED_DEVICE)
                output = ran[alike] = model(given)
        if not isinstance(output, torch.Tensor):
            handed = type(output).__name__
            raise StepMemoryError(f"pipeline stage {stage} of {type(whole).__name__} hands on {handed}, not a tensor")
        examples[stage] = (_on_meta(given), _on_meta(output))
        given = output.detach()
    return examples


@dataclass(frozen=True)
class PipelinedStep:
    """What every rank class's pipelined step shares: the settings (the split among them), the
    stages, the classes of ranks, each stage's microbatch input and output, the plan with its index."""

    settings: StepSettings
    stages: PipelineStages
    groups: tuple[RankGroup, ...]
    examples: Examples
    plan: ParallelPlan
    signatures: Sequence[object]
    """Each stage's modules, told apart (``pipeline.alike.stage_signatures``)."""

    def places(self) -> list[tuple[int, int, int]]:
        """Each class's pipeline rank, its first rank within it and its ranks (``traced_sources``)."""
        world = self.plan.context.world
        return [(world.coordinates(g.first)[PIPELINE_AXIS], g.first % world.stage_size, g.count) for g in self.groups]

    def actions_to_put_together(self) -> RankActions:
        """The ranks' lists of actions told apart for putting ranks together, traced at the fewest
        microbatches that give each rank a twin of every action (``with_fewer_microbatches``)."""
        single = self.stages.schedule.single_stage
        orders = single_stage_orders(self.stages) if single else lowered_orders(self.stages)
        return with_fewer_microbatches(RankActions(self.stages, self.signatures, orders, single_stage=single))

    def traced_step(self, actions: RankActions | None) -> PipelinedStep:
        """The step the ranks are traced at: this one at ``actions``' fewer microbatches, of the
        same size, or this one."""
        if actions is None or actions.traced is None:
            return self
        fewer = actions.traced.stages
        batch = self.settings.batch // self.stages.microbatches * fewer.microbatches
        return replace(self, settings=replace(self.settings, batch=batch, pipeline=fewer), stages=fewer)

    def inputs_bytes(self, pp_rank: int) -> int:
        """The bytes of the step's inputs pipeline rank ``pp_rank`` holds through the step: the
        token ids on the first stage's rank, the targets on the last's (``step_inputs``)."""
        tokens, targets = step_inputs(self.settings, self.stages.stages_of_rank(pp_rank), len(self.stages.stages), "meta")
        return sum(held.nbytes for held in (tokens, targets) if held is not None)


def pipelined_step(
    whole: nn.Module, plan: ParallelPlan, settings: StepSettings, pipeline: Pipeline | None, inputs: object | None
) -> PipelinedStep:
    """The pipeline ``pipeline`` asks for (default 1F1B, a microbatch per stage) over ``whole``
    (built on ``meta``; ``plan`` resolved for it, with its index), checked against the step."""
    assert plan.index is not None
    if inputs is not None:
        raise ValueError("inputs is not taken under a pipeline: the first stage takes token ids [batch, seq_len]")
    stages = split_stages(plan.index, plan.context.world.pp, pipeline or Pipeline())
    if (problem := stages.schedule.checkpointing_problem(settings.activation_checkpointing)) is not None:
        raise ValueError(problem)
    if settings.batch % stages.microbatches:
        raise ValueError(f"batch {settings.batch} does not split into {stages.microbatches} pipeline microbatches")
    groups = plan_report(plan.index, plan, optimizer="none", pipeline=stages).rank_groups
    signatures, microbatch = stage_signatures(plan.index, stages), settings.batch // stages.microbatches
    examples = stage_examples(whole, stages, signatures, microbatch, settings.seq_len, settings.routing)
    return PipelinedStep(replace(settings, pipeline=stages), stages, groups, examples, plan, signatures)


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's shape and dtype on ``meta``, needing a gradient when it can have one (a stage's
    output, and its input after the first stage, carry gradients between stages)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta").requires_grad_(tensor.is_floating_point())


PipelinedWatch = Callable[
    [list[nn.Module], Any, tuple[torch.Tensor | None, torch.Tensor | None], MeshContext, _PipelineSchedule],
    AbstractContextManager[Any],
]
"""``watch(stage_models, optimizer, (tokens, targets), mesh_context, schedule)``: what is entered around the step."""


class PipelinedMemoryWatch:
    """Step memory's watch over one rank's pipelined step (``run_pipelined_fake_step``'s
    ``watch``): torch's trackers over the rank's stages, each schedule action named as it starts,
    so that the peak names the action running at it. The step is cut into parts at each step torch's
    runtime takes and where the schedule ends (``parts``): what a rank with a twin of each action
    is put together from (``memory/composed.py``)."""

    def __init__(self, plan: ParallelPlan) -> None:
        assert plan.index is not None
        self.blocks = plan.index.layer_list()
        self._trackers: list[Any] = []
        self.orders: Orders | None = None
        """The lists of actions the step ran (``actions_run``)."""

    @contextmanager
    def __call__(
        self, models: list[nn.Module], optimizer: Any, inputs: Any, _: MeshContext, schedule: _PipelineSchedule
    ) -> Iterator[None]:
        tracker = step_tracker(models, optimizer, inputs, self.blocks)
        self._trackers.append(tracker)
        runtime_lists = on_each_runtime_step(schedule, lambda _: tracker.cut())
        _name_actions(schedule, tracker, cut_each=runtime_lists is None)
        self.orders = actions_run(schedule, runtime_lists)
        for stage in stages_of(schedule):
            stage.backward_weight_one_chunk = _then(stage.backward_weight_one_chunk, tracker.weight_gradients_made, stage.submod)
        with traced_step(tracker):
            tracker.cut()
            yield

    def peak(self) -> Peak:
        """The traced step's peak, the action and place it falls in, and each place's most bytes."""
        peak: Peak = self._trackers[0].peak()
        return peak

    def parts(self) -> list[StepPart]:
        """The step's parts: until torch's runtime takes its first step, each step it takes (under
        a single-stage schedule, each action from its start), and from the schedule's end."""
        parts: list[StepPart] = self._trackers[0].parts()
        return parts


def _then(run: Callable[..., Any], after: Callable[[nn.Module], None], stage: nn.Module) -> Callable[..., Any]:
    def ran(*args: Any, **kwargs: Any) -> Any:
        result = run(*args, **kwargs)
        after(stage)
        return result

    return ran


def run_pipelined_fake_step(
    whole: nn.Module,
    plan: ParallelPlan,
    stages: PipelineStages,
    examples: Examples,
    rank: int,
    settings: StepSettings,
    watch: PipelinedWatch,
) -> None:
    """``rank``'s stages cut from ``whole`` and planned as a job plans them, torch's stages and
    schedule over them, then one step of the schedule and the optimizer under ``watch``."""
    assert plan.index is not None
    world = plan.context.world
    count = len(stages.stages)
    mine = stages.stages_of_rank(world.coordinates(rank)[PIPELINE_AXIS])
    on_device = CudaAttention if settings.device is Device.CUDA else contextlib.nullcontext
    with without_torch_advice(), chunks_for_traced_rank(), fake_world(rank, world) as mesh_context:
        parts = []
        for stage in mine:
            keep = stages.keeps(stage)
            model = runnable_stage(stage_model(whole, keep), stage, count)
            part = StagePart(stage, model, replace(plan.only(keep), index=plan.index.restricted(model, keep)))
            apply_plan(part.model, part.plan, mesh_context, settings.activation_checkpointing, on_device)
            parts.append(part)
        plain = torch.empty(0)  # made outside the fake mode: what a real stage's output is
        with FakeTensorMode(allow_non_fake_inputs=True), assuming(settings.routing), on_device(), real_step_masks():
            models = [part.model for part in parts]
            for model in models:
                model.to_empty(device=TRACED_DEVICE)
            optimizer = make_optimizer(nn.ModuleList(models), settings.optimizer, settings.device, on_local_shards=True)
            make_optimizer_state(optimizer)
            last = next((part.model for part in parts if part.stage == count - 1), None)
            schedule = pipeline_schedule(
                stages, parts, mesh_context, TRACED_DEVICE, _scaled_loss(last, stages.microbatches), examples
            )
            tokens, targets = step_inputs(settings, mine, count, TRACED_DEVICE)
            _released_after_sending(schedule, plain)
            with watch(models, optimizer, (tokens, targets), mesh_context, schedule):
                pipelined_training_step(schedule, optimizer, tokens, targets)


def step_inputs(
    settings: StepSettings, mine: Sequence[int], count: int, device: str | torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The token ids a rank running stages ``mine`` of ``count`` feeds its first stage, and the
    targets its last stage's loss takes; ``None`` for those its stages do not take."""
    made = [torch.zeros(settings.batch, settings.seq_len, dtype=torch.long, device=device) if held else None
            for held in (0 in mine, count - 1 in mine)]  # fmt: skip
    return made[0], made[1]


def _scaled_loss(last: nn.Module | None, microbatches: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last stage's loss of one microbatch, divided by their count (torch scales nothing)."""
    loss = stage_loss(last) if last is not None else None

    def scaled(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert loss is not None  # torch calls it on the last stage only
        return loss(output, targets) / microbatches

    return scaled


def _released_after_sending(schedule: _PipelineSchedule, plain: torch.Tensor) -> None:
    """torch's stage drops its reference to an output once the output is sent (the backward starts
    from its gradient edge), but only for a plain tensor: a fake one would be kept to its backward,
    holding a microbatch's output longer than a real step does. Here a fake output is judged as
    the plain tensor it stands for."""
    for stage in stages_of(schedule):
        judge = stage._output_slot_is_releasable

        def releasable(output: Any, _judge: Any = judge) -> Any:
            return _judge(plain if isinstance(output, FakeTensor) else output)

        stage._output_slot_is_releasable = releasable


_ACTION_WORDS = {"F": "forward", "B": "backward", "I": "backward", "W": "weight gradients"}
AFTER_THE_SCHEDULE = "after the schedule"


def action_text(number: int, stage: int, kind: str, microbatch: int) -> str:
    """How the answer names the ``number``-th action a rank's stages run (``kind`` as torch names it)."""
    return f"action {number}: stage {stage} {_ACTION_WORDS[kind]} of microbatch {microbatch}"


def stage_actions(action: Any) -> list[tuple[str, int, int]]:
    """The kind, stage and microbatch of each action of a stage one of torch's runtime actions runs."""
    return [part for part in action_parts(action) if part[0] in _ACTION_WORDS]


def _name_actions(schedule: _PipelineSchedule, tracker: Any, cut_each: bool) -> None:
    """Each action torch's schedule runs on this rank's stages named on the tracker as it starts
    (``action 5: stage 1 backward of microbatch 2``), a part of its own with ``cut_each``, and what
    follows the schedule as ``after the schedule``, a part of its own."""
    numbers = itertools.count(1)

    def starting(stage: int, kind: str, microbatch: int) -> None:
        if cut_each:
            tracker.cut()
        if kind in _ACTION_WORDS:  # a release (GPipe's) is a part of its own, not a stage's action
            tracker.begin_action(action_text(next(numbers), stage, kind, microbatch))

    def ended() -> None:
        tracker.action = AFTER_THE_SCHEDULE
        tracker.cut()

    on_each_action(schedule, starting, ended)
