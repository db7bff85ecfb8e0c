"""A model's FLOPs per token as torchtitan counts them for its MFU (``torchtitan/models/utils.py``,
``get_dense_model_nparams_and_flops`` and ``get_moe_model_nparams_and_flops``):
``6 · N + 12 · L · H · Q · T``, with ``N`` the parameters without the embeddings (unless tied to the
head), an MoE's experts
counted at ``top_k / experts`` (the active ones), ``L`` layers, ``H`` attention heads of width
``Q``, ``T`` the sequence length. Recomputation is not counted, and the attention is counted whole
though causal (torchtitan's convention)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class _Shape:
    layers: int
    heads: int
    head_dim: int
    top_k: int | None
    experts: int | None


def model_flops_per_token(model: nn.Module, seq_len: int) -> int | None:
    """``model``'s FLOPs per token at ``seq_len`` (it may be on ``meta``), or ``None`` where its
    layers, heads and head width cannot be read: from a transformers config (``model.config``) or
    the demo's (``layers``, ``heads``, ``hidden``, ``experts``, ``top_k``)."""
    shape = _shape(getattr(model, "config", None))
    if shape is None:
        return None
    # A tied embedding is still the head's matmul: torchtitan counts it then.
    matmuls = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()} - matmuls
    active = 0.0
    for name, parameter in model.named_parameters():
        if id(parameter) in embeddings:
            continue
        routed = ".experts." in f".{name}" and shape.top_k is not None and shape.experts
        active += parameter.numel() * (shape.top_k / shape.experts if routed else 1)  # type: ignore[operator]
    return round(6 * active + 12 * shape.layers * shape.heads * shape.head_dim * seq_len)


def _shape(config: object) -> _Shape | None:
    read = {name: getattr(config, name, None) for name in _NAMES}
    layers = read["num_hidden_layers"] or read["layers"]
    heads = read["num_attention_heads"] or read["heads"]
    hidden = read["hidden_size"] or read["hidden"]
    if not all(isinstance(value, int) and value > 0 for value in (layers, heads)):
        return None
    head_dim = read["head_dim"] or (hidden // heads if isinstance(hidden, int) else None)  # type: ignore[operator]
    if not isinstance(head_dim, int):
        return None
    top_k = read["num_experts_per_tok"] or read["top_k"]
    experts = read["n_routed_experts"] or read["num_experts"] or read["num_local_experts"] or read["experts"]
    return _Shape(layers, heads, head_dim, top_k, experts)  # type: ignore[arg-type]


_NAMES = (
    "num_hidden_layers",
    "layers",
    "num_attention_heads",
    "heads",
    "hidden_size",
    "hidden",
    "head_dim",
    "num_experts_per_tok",
    "top_k",
    "n_routed_experts",
    "num_experts",
    "num_local_experts",
    "experts",
)
