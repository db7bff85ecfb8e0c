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

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshbind.binding import ParallelBinding
from meshbind.cp import CPContext
from meshbind.ep import EPContext
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


def local(parameter: torch.Tensor) -> torch.Tensor:
    """The tensor a module computes with: a ``DTensor``'s local shard (differentiably), else itself."""
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter


def _require_binding(module: nn.Module, binding: object, field: str) -> Any:
    context = getattr(binding, field, None)
    if context is None:
        raise ValueError(f"{type(module).__name__}.bind_parallel needs a binding with a {field}")
    return context


def _check_attention(*, module: nn.Module, sharding: ModuleShardingSpec, context: LayoutContext) -> None:
    assert isinstance(module, CPAttention)
    if module.hidden % module.heads:
        raise ValueError(f"hidden size {module.hidden} is not divisible by {module.heads} heads")
    tp = context.axis_sizes.get("tp", 1)
    if module.heads % tp:
        raise ValueError(f"{module.heads} heads are not divisible by the 'tp' axis size {tp}")


class _SumOverGroup(torch.autograd.Function):
    """The sum of every rank's partial tensor over a group; backward sums the gradients too, since
    every rank's loss depends on each rank's partial through the sum."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return waited(funcol.all_reduce(partial, "sum", group))

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        return waited(funcol.all_reduce(gradient.contiguous(), "sum", ctx.group)), None


def _attention_materialized(*, module: nn.Module, binding: ParallelBinding | None) -> None:
    for name, parameter in module.named_parameters():
        if parameter.is_meta or not torch.isfinite(local(parameter)).all():
            raise ValueError(f"parameter {name} is not materialised with finite values")


class CPAttention(nn.Module):
    """Causal multi-head self-attention; under CP each rank attends for its two sequence chunks."""

    parallel_spec = ParallelModuleSpec(
        "cp_causal_attention",
        "cp",
        stages={"shard_inputs": ("x",), "attend": ("q", "k", "v", "query_positions", "key_positions"), "restore": ("out",)},
        validate=_check_attention,
        validate_materialized=_attention_materialized,
    )

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.hidden, self.heads = hidden, heads
        # qkv's rows are head by head: (head, q/k/v, head_dim), so a Shard(0) holds whole heads.
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.cp: CPContext | None = None
        self.tp_group: Any = None

    def parallel_sharding(self, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        # Weights split by heads over tp (and whole over cp, which they need not name: FSDP folds cp
        # into its shard axis); the module takes and returns the whole sequence, replicated over tp.
        heads = {"qkv.weight": {"tp": Shard(0)}, "out.weight": {"tp": Shard(1)}} if "tp" in context.axis_sizes else {}
        return ModuleShardingSpec(
            params=heads,
            in_src={"cp": Replicate()},
            in_dst={"cp": Replicate()},
            out_src={"cp": Replicate()},
            out_dst={"cp": Replicate()},
        )

    def bind_parallel(self, binding: ParallelBinding) -> None:
        self.cp = _require_binding(self, binding, "cp_context")
        tp = binding.mesh_binding.axis_mesh("tp")
        self.tp_group = tp.get_group() if tp.size() > 1 else None

    def unbind_parallel(self) -> None:
        self.cp, self.tp_group = None, None

    def shard_inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.cp is None else self.cp.shard_sequence(x, 1)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
    ) -> torch.Tensor:
        """Softmax attention where a query sees the keys at or before its global position."""
        scores = q @ k.transpose(-2, -1) / (q.size(-1) ** 0.5)
        visible = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)
        return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.cp is None else self.cp.unshard_sequence(out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        local_x = self.shard_inputs(x=x)
        projected = nn.functional.linear(local_x, local(self.qkv.weight))
        head_size = self.hidden // self.heads
        # This rank's heads (all of them without tp), each with its query, key and value.
        per_head = projected.reshape(batch, local_x.size(1), -1, 3, head_size)
        q, k, v = (per_head.select(3, part).transpose(1, 2) for part in range(3))
        if self.cp is None:
            query_positions = key_positions = torch.arange(seq_len, device=x.device)
        else:
            k, v = self.cp.all_gather(k, 2), self.cp.all_gather(v, 2)
            query_positions = self.cp.positions(seq_len, device=x.device)
            key_positions = self.cp.gathered_positions(seq_len, device=x.device)
        attended = self.attend(q=q, k=k, v=v, query_positions=query_positions, key_positions=key_positions)
        heads_out = attended.transpose(1, 2).reshape(batch, attended.size(2), -1)
        out = nn.functional.linear(heads_out, local(self.out.weight))
        if self.tp_group is not None:  # each rank's heads give a partial sum of the projection
            out = _SumOverGroup.apply(out, self.tp_group)
        return self.restore(out=out)


def _check_experts(*, module: nn.Module, sharding: ModuleShardingSpec, context: LayoutContext) -> None:
    assert isinstance(module, MoELayer)
    if not 1 <= module.top_k <= module.num_experts:
        raise ValueError(f"top_k {module.top_k} must lie in [1, {module.num_experts}]")


def _experts_materialized(*, module: nn.Module, binding: ParallelBinding | None) -> None:
    assert isinstance(module, MoELayer)
    expected = module.num_experts if module.ep is None else module.ep.num_local_experts
    for name in MoELayer.EXPERT_WEIGHTS:
        weight = getattr(module, name)
        experts = _experts_computed(weight)
        if weight.is_meta or experts != expected:
            raise ValueError(f"{name} computes with {experts} local experts on {weight.device}, expected {expected} materialised")


def _experts_computed(weight: torch.Tensor) -> int:
    """The experts a rank computes with: the fused weight's experts split over its mesh's ``ep``
    dim (FSDP may hold fewer between steps; it gathers them for the forward)."""
    if not isinstance(weight, DTensor):
        return weight.size(0)
    names = weight.device_mesh.mesh_dim_names or ()
    if "ep" not in names:
        return weight.size(0)
    ep = names.index("ep")
    return weight.size(0) // weight.device_mesh.size(ep) if weight.placements[ep].is_shard(0) else weight.size(0)


class MoELayer(nn.Module):
    """Top-k routed SwiGLU experts with fused ``[E, ...]`` weights. A family per expert count: use
    ``moe_layer_class(num_experts)``, whose ``parallel_spec`` carries ``num_experts``."""

    EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
    parallel_spec: ParallelModuleSpec

    def __init__(self, hidden: int, intermediate: int, top_k: int) -> None:
        super().__init__()
        self.num_experts: int = self.parallel_spec.options["num_experts"]
        self.top_k = top_k
        self.router = nn.Linear(hidden, self.num_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(self.num_experts, intermediate, hidden))
        self.w_up = nn.Parameter(torch.empty(self.num_experts, intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(self.num_experts, hidden, intermediate))
        self.ep: EPContext | None = None

    def parallel_sharding(self, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        params: dict[str, dict[str, Any]] = {name: {"ep": Shard(0)} for name in self.EXPERT_WEIGHTS}
        params["router.weight"] = {"ep": Replicate()}
        return ModuleShardingSpec(params=params)

    def bind_parallel(self, binding: ParallelBinding) -> None:
        """The experts this rank owns are its weights' local shards (``apply_layouts`` made them)."""
        self.ep = _require_binding(self, binding, "ep_context")

    def unbind_parallel(self) -> None:
        self.ep = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts of each token and their renormalised weights."""
        weights, expert_ids = torch.softmax(nn.functional.linear(x, local(self.router.weight)), dim=-1).topk(self.top_k, dim=-1)
        return expert_ids, weights / weights.sum(dim=-1, keepdim=True)

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> Any:
        assert self.ep is not None
        return self.ep.dispatch(tokens, expert_ids)

    def compute(self, tokens: torch.Tensor, local_expert_ids: torch.Tensor) -> torch.Tensor:
        """Each token through its local expert, a SwiGLU over the fused weights' local experts."""
        gate = torch.einsum("th,tih->ti", tokens, local(self.w_gate)[local_expert_ids])
        up = torch.einsum("th,tih->ti", tokens, local(self.w_up)[local_expert_ids])
        return torch.einsum("ti,thi->th", nn.functional.silu(gate) * up, local(self.w_down)[local_expert_ids])

    def combine(self, expert_out: torch.Tensor, routed: Any, weights: torch.Tensor) -> torch.Tensor:
        assert self.ep is not None
        return self.ep.combine(expert_out, routed, weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.size(-1))
        expert_ids, weights = self.route(x=tokens)
        if self.ep is None:
            out = self.compute(tokens=tokens.repeat_interleave(self.top_k, dim=0), local_expert_ids=expert_ids.reshape(-1))
            combined = (out.view(-1, self.top_k, out.size(-1)) * weights.unsqueeze(-1)).sum(dim=1)
        else:
            routed = self.dispatch(tokens=tokens, expert_ids=expert_ids)
            expert_out = self.compute(tokens=routed.tokens, local_expert_ids=routed.local_expert_ids)
            combined = self.combine(expert_out=expert_out, routed=routed, weights=weights)
        return combined.view_as(x)


@functools.cache
def moe_layer_class(num_experts: int) -> type[MoELayer]:
    """The ``MoELayer`` family for ``num_experts`` (one class per count, made once)."""
    spec = ParallelModuleSpec(
        "ep_moe",
        "ep",
        stages={
            "route": ("x",),
            "dispatch": ("tokens", "expert_ids"),
            "compute": ("tokens", "local_expert_ids"),
            "combine": ("expert_out", "routed", "weights"),
        },
        validate=_check_experts,
        options={"num_experts": num_experts},
        validate_materialized=_experts_materialized,
    )
    return type(f"MoELayer{num_experts}", (MoELayer,), {"parallel_spec": spec, "__module__": __name__})


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

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head.loss(hidden=self.norm(x), targets=targets)


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
