"""What the pipeline tests run on every rank of a real gloo world."""

from __future__ import annotations

import torch
import torch.distributed as dist

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
