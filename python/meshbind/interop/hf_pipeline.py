"""A transformers causal LM's pipeline stage, made runnable by torch's ``PipelineStage``: its
forward takes token ids (the first stage) or hidden states, and hands on hidden states, or the
logits on the last stage, as tensors. transformers' own forward returns a model output and
applies the final norm and head, which a stage before the last does not hold."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn


def hf_stage(model: nn.Module, *, first: bool, last: bool) -> nn.Module:
    """Make ``model`` (a stage of a transformers ``...ForCausalLM``, cut by ``stage_model``: the
    modules it does not hold are ``None``) a stage torch can run, in place, and return it. The
    base model's own forward still makes the positions, the causal mask and the rotary embedding
    (every stage keeps ``rotary_emb``); a final norm the stage does not hold passes its input on."""
    base = getattr(model, "base_model", None)
    if not isinstance(base, nn.Module) or base is model:
        raise TypeError(f"{type(model).__name__} is not a transformers model with a base model and a head")
    for name, child in list(base._modules.items()):
        if child is None:
            base._modules[name] = nn.Identity()  # the base model's forward calls it; this stage does not hold it
    head = getattr(model, "get_output_embeddings", lambda: None)() if last else None
    if last and head is None:
        raise ValueError(f"the last stage of {type(model).__name__} holds no output head")

    def forward(self: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        given: dict[str, Any] = {"input_ids": inputs} if first else {"inputs_embeds": inputs}
        hidden: torch.Tensor = base(**given, use_cache=False).last_hidden_state
        return head(hidden) if head is not None else hidden

    model.forward = types.MethodType(forward, model)
    return model
