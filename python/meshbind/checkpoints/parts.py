"""What a save or a load is of: one model, or under a pipeline the stage models a rank runs
(each holding its modules under the whole model's FQNs, so their state dicts are one model's
keys, split), and what the ranks agree on before either."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from meshbind.agreement import check_ranks_agree, model_entries
from meshbind.mesh import MeshContext

Models = nn.Module | Sequence[nn.Module]
"""A model, or the stage models of one pipeline rank."""


def parts_of(model: Models) -> list[nn.Module]:
    if isinstance(model, nn.Module):
        return [model]
    parts = list(model)
    if not parts or not all(isinstance(part, nn.Module) for part in parts):
        raise TypeError("model must be an nn.Module or a non-empty sequence of them (a pipeline rank's stage models)")
    return parts


def merged_state(parts: Sequence[nn.Module]) -> dict[str, Any]:
    """The parts' state dicts as one: their keys are the whole model's, each in one part."""
    return {key: value for part in parts for key, value in part.state_dict().items()}


def agree_on(what: str, parts: Sequence[nn.Module], directory: str | os.PathLike[str], mesh_context: MeshContext | None) -> None:
    """Every rank agrees on the checkpoint's folder and its ranks on what they hold: every rank of
    the world, or under a pipeline (``mesh_context`` with a ``pp`` mesh) each stage's ranks on
    their stages' models, since ranks of other stages hold other modules."""
    target = ("checkpoint", os.fspath(directory))
    group = mesh_context.stage_group if mesh_context is not None else None
    if group is None:
        check_ranks_agree(what, lambda: [*(entry for part in parts for entry in model_entries(part)), target])
        return
    check_ranks_agree(what, lambda: [target])
    check_ranks_agree(what, lambda: [*(entry for part in parts for entry in model_entries(part)), target], group=group)
