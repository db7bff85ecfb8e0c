"""Attention as a real step runs it, traced: on a CUDA target, and with the masks transformers
builds for a real batch."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class CudaAttention(TorchFunctionMode):
    """For a CUDA target, ``scaled_dot_product_attention`` is traced as the kernel CUDA picks
    first: flash attention for half-precision inputs without a mask whose heads are all one size
    (it reads grouped key/value heads in place), else the memory-efficient kernel (which needs the
    key/value heads repeated for grouped-query attention). Both keep the output and a float32
    logsumexp per query, never the probabilities. On the CPU torch picks its math path for some
    shapes (a value head size other than the query's, as MLA's), which keeps them."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.scaled_dot_product_attention and args and args[0].dim() == 4:
            return cuda_attention(*args, **kwargs)
        return func(*args, **kwargs)


_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_SIZE = 256


def cuda_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    head = query.size(-1)
    flash = (
        query.dtype in _FLASH_DTYPES
        and attn_mask is None
        and key.size(-1) == value.size(-1) == head <= _FLASH_MAX_HEAD_SIZE
        and (enable_gqa or key.size(1) == query.size(1))
    )
    if flash:
        output: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale
        )[0]
        return output
    if enable_gqa and key.size(1) != query.size(1):
        groups = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:  # as SDPA turns a boolean mask into a bias for this kernel
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(~bias, float("-inf"))
        bias = bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    output = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, query.requires_grad, dropout_p, is_causal, scale=scale
    )[0]
    return output


@contextmanager
def real_step_masks() -> Iterator[None]:
    """transformers' SDPA masks as a real step builds them, while a step is traced.

    transformers reads a fake tensor as tracing (``is_tracing``), so under ``FakeTensorMode`` it
    takes the derived positions for packed sequences, materialises a ``[B, 1, S, S]`` causal mask
    and turns off SDPA's native GQA, where a real step on an unpacked, unpadded batch (the default
    inputs) passes no mask (``is_causal``). This installs, through transformers' own mask registry
    (``AttentionMaskInterface``, a local override of its ``"sdpa"`` entry, removed after), its own
    ``sdpa_mask`` with the causal skip a real step takes; masks that custom mask functions add
    (``use_vmap``) are built as before. A no-op when transformers is not loaded."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    registry = masking.ALL_MASK_ATTENTION_FUNCTIONS
    sdpa_mask = registry["sdpa"]

    def real_batch_sdpa_mask(*args: Any, allow_is_causal_skip: bool = True, use_vmap: bool = False, **kwargs: Any) -> Any:
        return sdpa_mask(*args, allow_is_causal_skip=allow_is_causal_skip or not use_vmap, use_vmap=use_vmap, **kwargs)

    overridden = registry._local_mapping.get("sdpa")
    registry["sdpa"] = real_batch_sdpa_mask
    try:
        yield
    finally:
        if overridden is None:
            del registry["sdpa"]
        else:
            registry["sdpa"] = overridden
