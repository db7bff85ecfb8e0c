"""What the pipeline tests run on every rank of a real gloo world."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshbind import resolve_plan
from meshbind.errors import RankMismatchError
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.mesh import MeshContext
from meshbind.pipeline import Pipeline, pipeline_parts


def split_with_other_microbatches() -> tuple[str | None, list[str]]:
    """The last rank asks for more microbatches than the others: every rank raises before any
    stage is cut, naming what differs; the error text (``None``: it went on) and this rank's
    stages' parameter FQNs had it gone on."""
    context = MeshContext.build(pp=dist.get_world_size(), ep=1)
    with torch.device("meta"):
        whole = MoETransformer(TransformerConfig(layers=4))
    plan = resolve_plan(whole, [loss_head_request()], context.layout_context(), index=True)
    last = dist.get_rank() == dist.get_world_size() - 1
    try:
        _, parts = pipeline_parts(whole, plan, Pipeline(microbatches=4 if last else 2), context)
    except RankMismatchError as error:
        return str(error), []
    return None, [fqn for part in parts for fqn, _ in part.model.named_parameters()]


def hf_pipelined(name: str, schedule: str, tp: int = 1) -> float | None:
    """A small transformers model (float64, 4 layers) trained one step at pp = the world size / ``tp``
    under ``schedule``, with its own TP plan in each stage when ``tp`` is above 1; on rank 0, the
    largest difference of the loss and of every (whole) gradient, relative to the whole model's in
    one process (each rank builds the same seeded model)."""
    from meshbind.appliers import apply_parallelism
    from meshbind.interop.hf_pipeline import hf_stage
    from meshbind.interop.hf_plans import from_hf_plan
    from meshbind.pipeline import pipeline_schedule

    from hf_models import hf_model

    context = MeshContext.build(pp=dist.get_world_size() // tp, tp=tp)
    whole = hf_model(name, layers=4).double()
    whole.config._experts_implementation = "eager"  # grouped_mm takes no float64
    vocab = whole.config.vocab_size
    ids = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(1))

    def loss_of(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """transformers' causal LM loss (each token predicts the next), in the logits' dtype."""
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))

    plan = resolve_plan(whole, from_hf_plan(whole) if tp > 1 else [], context.layout_context(), index=True)
    stages, parts = pipeline_parts(whole, plan, Pipeline(schedule, microbatches=4), context)
    last_stage = len(stages.stages) - 1
    for part in parts:
        apply_parallelism(part.model, part.plan, context)  # transformers' own TP, agreed within the stage
        hf_stage(part.model, first=part.stage == 0, last=part.stage == last_stage)
    built = pipeline_schedule(stages, parts, context, torch.device("cpu"), lambda out, labels: loss_of(out, labels) / 4)
    losses: list[torch.Tensor] = []
    first, last = any(part.stage == 0 for part in parts), any(part.stage == last_stage for part in parts)
    built.step(*((ids,) if first else ()), target=ids if last else None, losses=losses)
    mine = {fqn: whole_tensor(p.grad) for part in parts for fqn, p in part.model.named_parameters() if p.grad is not None}
    loss = torch.stack(losses).sum() if losses else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(loss)
    loss /= tp  # each of the last stage's tp ranks holds the loss
    received: list[dict[str, torch.Tensor]] | None = [{}] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, received, dst=0)
    if received is None:
        return None
    reference_loss = loss_of(whole(input_ids=ids, use_cache=False).logits, ids)
    reference_loss.backward()
    gradients = {fqn: gradient for part in received for fqn, gradient in part.items()}
    worst = abs(float(loss) - float(reference_loss)) / abs(float(reference_loss))
    for fqn, parameter in whole.named_parameters():
        assert parameter.grad is not None, fqn
        scale = float(parameter.grad.abs().max()) or 1.0
        worst = max(worst, float((gradients[fqn] - parameter.grad).abs().max()) / scale)
    return worst


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh), a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def one_stage_rank_differs() -> str | None:
    """pp=2 stages of two tp ranks; the world's last rank leaves a block out of its stage's plan
    before the layouts: its stage's ranks refuse, naming it, and the other stage's apply theirs.
    This rank's error text (``None``: it applied)."""
    from rank_agreement_checks import blocks, request

    from meshbind import apply_layouts

    context = MeshContext.build(pp=2, tp=2)
    whole = blocks(4, meta=True)
    plan = resolve_plan(whole, [request("layers.*")], context.layout_context(), index=True)
    _, parts = pipeline_parts(whole, plan, Pipeline("GPipe"), context)
    if dist.get_rank() == dist.get_world_size() - 1:
        part = parts[0]
        parts = [replace(part, plan=replace(part.plan.only(lambda fqn: fqn != "layers.3"), index=part.plan.index))]
    try:
        for part in parts:
            apply_layouts(part.model, part.plan, context)
    except RankMismatchError as error:
        return str(error)
    return None


def outputs_kept_by_the_last_stage() -> int:
    """How many microbatch outputs torch's last stage (here the only one, on a world of one rank)
    still holds after one ``pipelined_training_step`` under 1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from meshbind.memory.step import pipelined_training_step

    stage = PipelineStage(torch.nn.Linear(4, 4), 0, 1, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=lambda output, target: (output - target).square().mean())
    pipelined_training_step(schedule, None, torch.randn(2, 4), torch.randn(2, 4))
    return len(stage.output_chunks)
