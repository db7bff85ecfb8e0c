"""A Hugging Face-style mixture-of-experts module tree, built on the ``meta`` device.

``L x E`` (layers x experts) sets the size: each expert is its own module with ``gate_proj``,
``up_proj`` and ``down_proj``, beside the attention projections, a router ``gate``,
``shared_experts`` and layer norms (61 x 1024 is about 250k modules). The tensors are tiny and on
``meta``: these trees exist to be planned, not run.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate

from meshbind.specs import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec

HIDDEN = 8
INTERMEDIATE = 4


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)


class FusedExperts(nn.Module):
    """All experts of a layer as one module: one ``[E, ...]`` parameter per projection."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, INTERMEDIATE, HIDDEN))
        self.up_proj = nn.Parameter(torch.empty(num_experts, INTERMEDIATE, HIDDEN))
        self.down_proj = nn.Parameter(torch.empty(num_experts, HIDDEN, INTERMEDIATE))

    def forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """``tokens[T, H]``, each sent to ``expert_ids[T]``: a SwiGLU per token with its expert's weights."""
        gate = torch.einsum("th,tih->ti", tokens, self.gate_proj[expert_ids])
        up = torch.einsum("th,tih->ti", tokens, self.up_proj[expert_ids])
        return torch.einsum("ti,thi->th", nn.functional.silu(gate) * up, self.down_proj[expert_ids])

    def bind_parallel(self, binding: object) -> None:
        self.binding = binding


class SparseMoeBlock(nn.Module):
    def __init__(self, num_experts: int, fused_experts: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, num_experts, bias=False)
        self.experts: nn.Module = (
            FusedExperts(num_experts) if fused_experts else nn.ModuleList(Expert() for _ in range(num_experts))
        )
        self.shared_experts = Expert()


class DecoderLayer(nn.Module):
    def __init__(self, num_experts: int, fused_experts: bool) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = SparseMoeBlock(num_experts, fused_experts)


class MoeForCausalLM(nn.Module):
    def __init__(self, num_layers: int, num_experts: int, vocab: int = 32, *, fused_experts: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, HIDDEN)
        self.layers = nn.ModuleList(DecoderLayer(num_experts, fused_experts) for _ in range(num_layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, vocab, bias=False)


def build_moe_tree(num_layers: int, num_experts: int, *, fused_experts: bool = False) -> MoeForCausalLM:
    """The tree on the ``meta`` device: no memory is allocated for its parameters.

    With ``fused_experts`` each layer's experts are one ``FusedExperts`` module instead of a
    ``ModuleList`` of per-expert modules.
    """
    with torch.device("meta"):
        return MoeForCausalLM(num_layers, num_experts, fused_experts=fused_experts)


def moe_tree_fqns(num_layers: int, num_experts: int) -> list[str]:
    """Every FQN ``build_moe_tree`` would have, as strings, without building modules."""
    names = ["", "embed_tokens", "layers"]
    for layer in range(num_layers):
        base = f"layers.{layer}"
        names += [base, f"{base}.input_layernorm", f"{base}.self_attn"]
        names += [f"{base}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [f"{base}.post_attention_layernorm", f"{base}.mlp", f"{base}.mlp.gate", f"{base}.mlp.experts"]
        for expert in range(num_experts):
            e = f"{base}.mlp.experts.{expert}"
            names += [e, f"{e}.gate_proj", f"{e}.up_proj", f"{e}.down_proj"]
        s = f"{base}.mlp.shared_experts"
        names += [s, f"{s}.gate_proj", f"{s}.up_proj", f"{s}.down_proj"]
    names += ["norm", "lm_head"]
    return names


DEEP_PLAN: tuple[str, ...] = (
    "layers.*.mlp.experts.*.gate_proj",
    "layers.*.mlp.experts.*.up_proj",
    "layers.*.mlp.experts.*.down_proj",
    "layers.*.self_attn.q_proj",
    "layers.*.self_attn.k_proj",
    "layers.*.self_attn.v_proj",
    "layers.*.self_attn.o_proj",
    "layers.*.mlp.gate",
    "lm_head",
    "embed_tokens",
)
"""The per-expert projections, the attention projections, the router and the two ends."""

MOE_PLAN: tuple[str, ...] = ("layers.*.mlp.experts", *(p for p in DEEP_PLAN if ".experts." not in p))
"""For a tree with fused experts: the deep plan with each layer's ``FusedExperts`` in place of the
per-expert projections."""


def small_moe_tree() -> MoeForCausalLM:
    """A 4 x 8 tree: the default model of ``meshbind check`` examples."""
    return MoeForCausalLM(4, 8)


def deepseek_sized_tree() -> MoeForCausalLM:
    """DeepSeek-V3's 61 layers of 256 experts each (63k modules): ``meshbind bench``'s default model."""
    return MoeForCausalLM(61, 256)


def deep_plan_requests() -> tuple[NativeParallelBindingRequest, ...]:
    """``DEEP_PLAN`` as requests: every projection a ``linear`` module with a replicated weight."""
    spec = ParallelModuleSpec("linear", stages={"forward": ("input",)})
    replicated = ModuleShardingSpec(params={"weight": {"tp": Replicate()}})

    def sharding(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return replicated

    return tuple(NativeParallelBindingRequest((pattern,), spec, sharding) for pattern in DEEP_PLAN)
