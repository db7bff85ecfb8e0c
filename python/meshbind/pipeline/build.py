"""A pipeline built by torch: this rank's stages cut from the whole model on ``meta`` (full FQNs
kept), each stage's part of the plan, and torch's ``PipelineStage``s and schedule over the
``pp`` mesh. The rest of the plan (layouts, binding, FSDP) applies to each stage's model as to a
whole model, between ``pipeline_parts`` and ``pipeline_schedule``, as torchtitan applies it."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineSchedule, get_schedule_class

from meshbind.agreement import Entry, check_ranks_agree, model_entries, plan_entries
from meshbind.errors import PipelineError
from meshbind.mesh import MeshContext
from meshbind.pipeline.stages import Pipeline, PipelineStages, split_stages
from meshbind.resolution.plan import ParallelPlan


@dataclass(frozen=True)
class StagePart:
    """One stage this rank runs: its index, its model (the whole model's modules it holds, under
    their full FQNs) and the plan of those modules."""

    stage: int
    model: nn.Module
    plan: ParallelPlan


def pipeline_parts(
    whole: nn.Module, plan: ParallelPlan, pipeline: Pipeline, mesh_context: MeshContext
) -> tuple[PipelineStages, list[StagePart]]:
    """Split ``whole`` (built on ``meta``, ``plan`` resolved for it with ``index=True``) into the
    stages this rank runs. The ranks agree on the whole model, its plan and the split before
    anything is cut (``RankMismatchError`` otherwise)."""
    if plan.index is None:
        raise ValueError("pipeline_parts needs the plan's model index: resolve_plan(..., index=True)")
    pp_mesh = mesh_context.pp_mesh
    pp = plan.context.world.pp
    if pp_mesh is None or pp_mesh.size() != pp:
        has = "no pp mesh" if pp_mesh is None else f"pp={pp_mesh.size()}"
        raise PipelineError([f"the plan has pp={pp}, but the mesh context has {has}"])
    stages = split_stages(plan.index, pp, pipeline)
    check_ranks_agree("pipeline", lambda: [*model_entries(whole, plan.index), *plan_entries(plan), *pipeline_entries(stages)])
    parts = []
    for stage in stages.stages_of_rank(pp_mesh.get_local_rank()):
        keep = stages.keeps(stage)
        model = stage_model(whole, keep)
        parts.append(StagePart(stage, model, replace(plan.only(keep), index=plan.index.restricted(model, keep))))
    return stages, parts


def pipeline_entries(stages: PipelineStages) -> list[Entry]:
    """What the ranks of a pipeline must agree on before the first send."""
    return [
        ("pipeline schedule", stages.schedule.name),
        ("pipeline microbatches", str(stages.microbatches)),
        *((f"pipeline stage {index}", ", ".join(modules)) for index, modules in enumerate(stages.stages)),
    ]


def stage_model(whole: nn.Module, keep: Callable[[str], bool]) -> nn.Module:
    """A copy of ``whole`` holding the modules ``keep`` admits, each under its full FQN: a layer
    list keeps its members' names (``layers.4`` stays ``layers.4`` in a stage holding blocks 4 to
    7), a layer list none of whose blocks it holds is empty, and any other module left out becomes
    ``None``, which the model's forward skips."""
    removed: list[tuple[str, str, nn.Module]] = []
    for fqn, module in whole.named_modules():
        for name, child in module._modules.items():
            if child is not None and keep(fqn) and not keep(f"{fqn}.{name}" if fqn else name):
                removed.append((fqn, name, child))
    # The modules left out are never copied: deepcopy takes None for each (a stage copies its own blocks alone).
    model = copy.deepcopy(whole, {id(child): None for _, _, child in removed})
    for fqn, name, child in removed:
        parent = model.get_submodule(fqn)
        if isinstance(parent, nn.ModuleList):
            del parent._modules[name]  # the others keep their keys, and so their FQNs
        elif isinstance(child, nn.ModuleList):
            parent._modules[name] = nn.ModuleList()  # a stage without blocks still loops over its (no) blocks
        else:
            parent._modules[name] = None
    return model


def runnable_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """A stage model torch's ``PipelineStage`` can run: a transformers causal LM's made so by
    ``hf_stage`` (its forward takes ids or hidden states and hands on tensors), any other as it is
    (its own forward skips the modules the stage does not hold)."""
    if type(model).__module__.startswith("transformers."):
        from meshbind.interop.hf_pipeline import hf_stage

        return hf_stage(model, first=stage == 0, last=stage == stages - 1)
    return model


def stage_loss(last: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of one microbatch from the last stage's output and its targets: the last stage
    model's own ``pipeline_loss(output, targets)`` when it has one, else the cross entropy of the
    output's last dimension (a head's logits) against the targets, as torchtitan computes it."""
    own = getattr(last, "pipeline_loss", None)
    if callable(own):
        return own  # type: ignore[no-any-return]

    def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())

    return cross_entropy


def pipeline_schedule(
    stages: PipelineStages,
    parts: list[StagePart],
    mesh_context: MeshContext,
    device: torch.device,
    loss: Callable[..., torch.Tensor],
    examples: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> _PipelineSchedule:
    """torch's ``PipelineStage`` for each of this rank's parts (their models as the rest of the
    plan left them) and torch's schedule over them, ``loss(output, target)`` on the last stage.
    torch scales nothing: ``loss`` divides by the microbatches itself (torchtitan's
    ``rescale_accumulated_loss``). ``examples`` gives a stage's microbatch input and output
    (torch otherwise learns them from the stages before it at the first step)."""
    assert mesh_context.pp_mesh is not None
    group = mesh_context.pp_mesh.get_group()
    built = []
    for part in parts:
        given, handed_on = (None, None) if examples is None else examples[part.stage]
        built.append(
            PipelineStage(
                part.model, part.stage, len(stages.stages), device, input_args=given, output_args=handed_on, group=group
            )
        )
    schedule_class: Any = get_schedule_class(stages.schedule.name)
    runs: Any = built[0] if stages.schedule.single_stage else built
    schedule: _PipelineSchedule = schedule_class(runs, n_microbatches=stages.microbatches, loss_fn=loss, scale_grads=False)
    return schedule
