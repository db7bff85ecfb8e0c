"""Attention on a CUDA target, traced on the CPU."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class CudaAttention(TorchFunctionMode):
    """For a CUDA target, ``scaled_dot_product_attention`` is traced as CUDA's memory-efficient
    kernel: it keeps, as the flash kernel does, the output and a float32 logsumexp per query, never
    the probabilities. On the CPU torch picks its math path for some shapes (a value head size
    other than the query's, as MLA's), which keeps them."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.scaled_dot_product_attention and args and args[0].dim() == 4:
            return efficient_attention(*args, **kwargs)
        return func(*args, **kwargs)


def efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if enable_gqa and key.size(1) != query.size(1):
        groups = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:  # as SDPA turns a boolean mask into a bias for this kernel
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(~bias, float("-inf"))
        bias = bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    output: torch.Tensor = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, query.requires_grad, dropout_p, is_causal, scale=scale
    )[0]
    return output
