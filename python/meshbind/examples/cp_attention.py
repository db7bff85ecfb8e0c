"""``CPAttention``: a family module owning the ``cp`` protocol, its heads split over ``tp``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshbind._core import not_divisible
from meshbind.binding import ParallelBinding
from meshbind.cp import CPContext
from meshbind.examples.parallel_parts import local, require_binding
from meshbind.mesh import waited
from meshbind.specs import LayoutContext, ModuleShardingSpec, ParallelModuleSpec


def _check_attention(*, module: nn.Module, sharding: ModuleShardingSpec, context: LayoutContext) -> None:
    assert isinstance(module, CPAttention)
    if module.hidden % module.heads:
        raise ValueError(f"hidden size {module.hidden} is not divisible by {module.heads} heads")
    if (problem := not_divisible("heads", module.heads, "tp", context.axis_sizes.get("tp", 1))) is not None:
        raise ValueError(problem)


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
        self.cp = require_binding(self, binding, "cp_context")
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
