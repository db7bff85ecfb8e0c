"""What the example's parallel modules share: a parameter's local tensor, and the binding a
module must have been given before it computes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local(parameter: torch.Tensor) -> torch.Tensor:
    """The tensor a module computes with: a ``DTensor``'s local shard (differentiably), else itself."""
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter


def require_binding(module: nn.Module, binding: object, field: str) -> Any:
    context = getattr(binding, field, None)
    if context is None:
        raise ValueError(f"{type(module).__name__}.bind_parallel needs a binding with a {field}")
    return context
