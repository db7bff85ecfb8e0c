"""The demo's model: a small but real mixture-of-experts transformer whose parallel parts own
their protocols.

- ``CPAttention`` is a family module owning the ``cp`` protocol: it shards the sequence
  head-tail, gathers keys and values from the other CP ranks, attends causally by global
  position and restores the full sequence. Everything around it sees the whole sequence. Over
  ``tp`` it splits the heads: ``qkv`` is ``Shard(0)`` (its rows are laid out head by head, so each
  rank's shard holds whole heads' queries, keys and values), ``out`` is ``Shard(1)`` (the input
  dimension), and the partial sums of ``out`` are reduced over the prebuilt ``tp`` mesh, forward
  and backward.
- ``MoELayer`` is a family module owning the ``ep`` protocol: it routes each token to its top-k
  experts, dispatches them to the ranks owning those experts, runs its local experts over fused
  ``[E, ...]`` weights (``Shard(0)`` on ``ep``: after ``apply_layouts`` each rank's local tensor
  holds its ``E / ep`` experts) and combines the results.
- ``LossHead`` is bound by FQN pattern through a ``NativeParallelBindingRequest`` (kind ``mesh``):
  it takes the data-parallel axis meshes to normalise the loss by the global token count.

Explicit modules compute on their parameters' local tensors (``local``): a ``DTensor``
parameter's own shard, a plain parameter itself. Unbound and undistributed, the same modules
compute the single-process reference.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from meshbind.binding import ParallelBinding
from meshbind.examples.cp_attention import CPAttention
from meshbind.examples.moe_layer import moe_layer_class
from meshbind.examples.parallel_parts import local
from meshbind.mesh import waited
from meshbind.specs import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec


@dataclass(frozen=True)
class TransformerConfig:
    layers: int = 2
    experts: int = 8
    hidden: int = 32
    heads: int = 4
    intermediate: int = 64
    vocab: int = 96
    top_k: int = 2


class LossHead(nn.Module):
    """The output projection and the loss. Bound with the data-parallel axis meshes, it divides by
    the global token count and by how many ranks hold each token, so summing every rank's loss (and
    gradient) gives the mean over the global batch."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, vocab, bias=False)
        self.binding: ParallelBinding | None = None

    def bind_parallel(self, binding: ParallelBinding) -> None:
        self.binding = binding

    def unbind_parallel(self) -> None:
        self.binding = None

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(hidden, local(self.proj.weight))
        total = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
        if self.binding is None:
            return total / targets.numel()
        meshes = self.binding.mesh_binding
        global_count = torch.tensor([float(targets.numel())], dtype=total.dtype, device=total.device)
        for axis in ("dp_replicate", "dp_shard"):  # the batch is split over both
            global_count = waited(funcol.all_reduce(global_count, "sum", meshes.axis_mesh(axis).get_group()))
        holders = meshes.axis_mesh("cp").size() * meshes.axis_mesh("tp").size()
        return total / (global_count[0] * holders)


def loss_head_request() -> NativeParallelBindingRequest:
    """``head`` joins the plan by FQN pattern, as a ``mesh``-kind module with one stage."""
    spec = ParallelModuleSpec("mesh_loss_head", "mesh", stages={"loss": ("hidden", "targets")}, validate=_accept)

    def replicated(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        # Whole on every tp rank (the data-parallel axes are FSDP's, or replicate it implicitly).
        return ModuleShardingSpec(params={"proj.weight": {"tp": Replicate()}} if "tp" in context.axis_sizes else {})

    return NativeParallelBindingRequest(("head",), spec, replicated)


def _accept(**kwargs: Any) -> None:
    return None


class DecoderBlock(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden)
        self.attn = CPAttention(config.hidden, config.heads)
        self.moe_norm = nn.LayerNorm(config.hidden)
        self.moe = moe_layer_class(config.experts)(config.hidden, config.intermediate, config.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        out: torch.Tensor = x + self.moe(self.moe_norm(x))
        return out


class MoETransformer(nn.Module):
    def __init__(self, config: TransformerConfig = TransformerConfig()) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.blocks = nn.ModuleList(DecoderBlock(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.head = LossHead(config.hidden, config.vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The loss; as a pipeline stage (modules it does not hold are ``None``), what its last
        block or its norm hands on: a stage without the embedding takes hidden states, and the
        last stage's schedule computes the loss (``head.loss``) from its output."""
        x = self.embed(tokens) if self.embed is not None else tokens
        for block in self.blocks:
            x = block(x)
        if self.norm is None:
            return x
        hidden: torch.Tensor = self.norm(x)
        return hidden if targets is None else self.head.loss(hidden=hidden, targets=targets)

    def pipeline_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one microbatch on the last pipeline stage, from what its forward hands on."""
        return self.head.loss(hidden=hidden, targets=targets)


def initialize(model: MoETransformer, seed: int) -> None:
    """Deterministic values from the seed and each parameter's FQN, the same with or without
    parallelism: a ``DTensor`` parameter takes its shard of the full tensor (every rank makes the
    same full tensor, so no rank needs another's)."""
    with torch.no_grad():
        for module_fqn, module in model.named_modules():
            for name, parameter in module.named_parameters(recurse=False):
                fqn = f"{module_fqn}.{name}" if module_fqn else name
                shape = tuple(parameter.shape)
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
                if name == "weight" and isinstance(module, nn.LayerNorm):
                    full = 1.0 + 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
                elif name == "bias":
                    full = 0.1 * torch.randn(shape, generator=generator, dtype=torch.float64)
                else:
                    full = torch.randn(shape, generator=generator, dtype=torch.float64) / (shape[-1] ** 0.5)
                if isinstance(parameter, DTensor):
                    full = distribute_tensor(full, parameter.device_mesh, parameter.placements, src_data_rank=None).to_local()
                local(parameter).copy_(full.to(parameter.dtype))


def batch(config: TransformerConfig, batch_size: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded batch of token ids and next-token targets."""
    generator = torch.Generator().manual_seed(seed + 17)
    tokens = torch.randint(0, config.vocab, (batch_size, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
