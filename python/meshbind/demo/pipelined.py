"""The demo's step under a pipeline (``--pp`` above 1): this rank's stages cut from the model on
``meta``, the rest of the plan applied to each, and one step of torch's schedule over the batch in
microbatches. Each microbatch's loss is divided by their count, so the gradients sum to those of
the whole batch, as in the one-process reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import _PipelineSchedule

from meshbind.binding import bind_parallel_modules, validate_materialized_modules
from meshbind.checkpoints import load_checkpoint
from meshbind.demo.config import DemoConfig
from meshbind.examples.moe_transformer import MoETransformer, initialize
from meshbind.fsdp import apply_fully_shard
from meshbind.layouts import apply_layouts
from meshbind.mesh import MeshContext
from meshbind.pipeline import Pipeline, PipelineStages, StagePart, pipeline_parts, pipeline_schedule
from meshbind.report import plan_report
from meshbind.resolution.plan import ParallelPlan


@dataclass
class PipelinedStep:
    """This rank's stages after one step: their models, its share of the loss, the stages' split,
    the plan report's parameter bytes for them, and how many modules were bound."""

    models: list[nn.Module]
    loss: torch.Tensor
    stages: PipelineStages
    predicted_bytes: int
    bound: int
    schedule: _PipelineSchedule
    first: bool
    """Whether this rank runs the first stage (it is given the tokens)."""
    last: bool
    """Whether this rank runs the last stage (it is given the targets, and computes the loss)."""

    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's share of the loss of a forward pass alone (torch's ``schedule.eval``)."""
        losses: list[torch.Tensor] = []
        self.schedule.eval(*((tokens,) if self.first else ()), target=targets if self.last else None, losses=losses)
        return _summed_losses(losses, tokens.device)


def pipelined_step(
    config: DemoConfig,
    whole: MoETransformer,
    plan: ParallelPlan,
    mesh_context: MeshContext,
    device: torch.device,
    tokens: torch.Tensor,
    targets: torch.Tensor,
) -> PipelinedStep:
    """Cut, apply, materialise and run one step of this rank's stages; ``tokens`` and ``targets``
    are this data-parallel rank's rows."""
    pipeline = Pipeline(schedule=config.pp_schedule, microbatches=config.pp_microbatches)
    stages, parts = pipeline_parts(whole, plan, pipeline, mesh_context)
    # What this rank will hold, from the whole model's plan and the split alone.
    predicted = plan_report(whole, plan, optimizer="none", pipeline=stages).ranks[dist.get_rank()].parameter_bytes
    bound = 0
    for part in parts:
        apply_layouts(part.model, part.plan, mesh_context)
        bound += len(bind_parallel_modules(part.model, part.plan, mesh_context))
        if config.fsdp:
            apply_fully_shard(part.model, part.plan, mesh_context)
            for module in part.model.modules():
                if isinstance(module, FSDPModule):  # the loss is the global mean: sum, not average
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
        part.model.to_empty(device=device)
        assert isinstance(part.model, MoETransformer)
        if config.load is None:
            initialize(part.model, config.seed)  # each value from its full FQN: the same as in the whole model
    models = [part.model for part in parts]
    if config.load is not None:
        load_checkpoint(models, config.load, allow_unverified=config.allow_unverified, mesh_context=mesh_context)
    for model in models:
        validate_materialized_modules(model)
    last = _last_stage(stages, parts)
    microbatches = stages.microbatches

    def loss(hidden: torch.Tensor, microbatch_targets: torch.Tensor) -> torch.Tensor:
        assert last is not None
        return last.pipeline_loss(hidden, microbatch_targets) / microbatches

    schedule = pipeline_schedule(stages, parts, mesh_context, device, loss)
    losses: list[torch.Tensor] = []
    first = any(part.stage == 0 for part in parts)
    schedule.step(*((tokens,) if first else ()), target=targets if last is not None else None, losses=losses)
    total = _summed_losses(losses, device)
    return PipelinedStep(models, total, stages, predicted, bound, schedule, first, last is not None)


def _summed_losses(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The microbatches' losses summed (each already divided by their count); zero on a rank
    without the last stage."""
    return torch.stack([value.detach() for value in losses]).sum() if losses else torch.zeros((), device=device)


def _last_stage(stages: PipelineStages, parts: list[StagePart]) -> MoETransformer | None:
    """This rank's model of the last stage (it holds the loss head), if it runs it."""
    for part in parts:
        if part.stage == len(stages.stages) - 1:
            assert isinstance(part.model, MoETransformer)
            return part.model
    return None


def gradients_on_first_rank(gradients: dict[str, torch.Tensor], mesh_context: MeshContext) -> dict[str, torch.Tensor]:
    """Every stage's full gradients on rank 0 (from the first rank of each stage): all of the
    model's, where the reference's are compared."""
    assert mesh_context.pp_mesh is not None
    first_of_stage = mesh_context.device_mesh.mesh.flatten()[0].item() == dist.get_rank()
    sent = {name: gradient.cpu() for name, gradient in gradients.items()} if first_of_stage else {}
    received: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sent, received, dst=0)
    return {name: gradient for part in received or [] for name, gradient in part.items()}
