"""Expert parallelism over a one-dimensional mesh: each rank owns a contiguous, balanced
range of experts; ``dispatch`` sends every (token, choice) to the rank owning its expert with an
uneven all-to-all, and ``combine`` brings the results back and sums them with the routing weights.
Both go through torch's functional collectives, so autograd flows through them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from meshbind.mesh import one_dimensional, waited
from meshbind.routing import assumed_routing


@dataclass(frozen=True)
class RoutedTokens:
    """What ``dispatch`` delivered to this rank, and what ``combine`` needs to send it back."""

    tokens: torch.Tensor
    """``[R, H]``: the tokens this rank's experts must process."""
    local_expert_ids: torch.Tensor
    """``[R]`` int64: which local expert (``0 <= id < num_local_experts``) each received token goes to."""
    order: torch.Tensor
    """``[T * K]``: the (token, choice) pairs in the order they were sent (sorted by expert)."""
    send_counts: list[int]
    recv_counts: list[int]
    num_tokens: int
    top_k: int


class EPContext:
    """Expert-parallel resources: ``mesh``, ``group``, ``size``, ``rank`` and the local experts
    ``[local_expert_start, local_expert_stop)`` of ``num_experts``."""

    def __init__(self, mesh: DeviceMesh, num_experts: int) -> None:
        self.mesh = one_dimensional(mesh, "EPContext")
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        if num_experts % self.size:
            raise ValueError(f"num_experts {num_experts} is not divisible by the ep size {self.size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.size
        self.local_expert_start = self.rank * self.num_local_experts
        self.local_expert_stop = self.local_expert_start + self.num_local_experts

    def __repr__(self) -> str:
        local = f"[{self.local_expert_start}, {self.local_expert_stop})"
        return f"EPContext(rank={self.rank}, size={self.size}, experts={local} of {self.num_experts})"

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> RoutedTokens:
        """Send each ``(token, choice)`` of ``tokens[T, H]`` and ``expert_ids[T, K]`` to its expert's rank."""
        if tokens.dim() != 2 or expert_ids.dim() != 2 or expert_ids.size(0) != tokens.size(0):
            raise ValueError(
                f"dispatch needs tokens[T, H] and expert_ids[T, K], got {tuple(tokens.shape)} and {tuple(expert_ids.shape)}"
            )
        if expert_ids.dtype.is_floating_point or expert_ids.dtype.is_complex or expert_ids.dtype == torch.bool:
            raise ValueError(f"expert_ids must hold integers, got {expert_ids.dtype}")
        num_tokens, top_k = expert_ids.shape
        # int64 whatever came in: backends lack some integer types (gloo: int16), and uint8 ids
        # would index the experts' weights as a mask.
        flat_experts = expert_ids.reshape(-1).long()
        assumed = assumed_routing()
        out_of_range = assumed is None and flat_experts.numel() > 0
        if out_of_range and (int(flat_experts.min()) < 0 or int(flat_experts.max()) >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts})")
        order = torch.argsort(flat_experts, stable=True)
        sorted_experts = flat_experts[order]
        destination = torch.div(sorted_experts, self.num_local_experts, rounding_mode="floor")
        send_tokens = tokens.index_select(0, torch.div(order, top_k, rounding_mode="floor"))
        local_ids = sorted_experts - destination * self.num_local_experts
        if assumed is not None:  # a traced step: the counts are assumed, the ids hold no data
            send_counts, recv_counts = assumed.counts(num_tokens * top_k, self.size)
            send_counts_tensor = torch.tensor(send_counts, device=tokens.device)
        else:
            send_counts_tensor = torch.bincount(destination, minlength=self.size)
        # The receivers learn their counts first: every rank sends one count to every rank (a
        # traced step too, so that its collectives are the real step's).
        recv_counts_tensor = waited(funcol.all_to_all_single(send_counts_tensor, None, None, self.group))
        if assumed is None:
            send_counts, recv_counts = send_counts_tensor.tolist(), recv_counts_tensor.tolist()
        received = waited(funcol.all_to_all_single_autograd(send_tokens, recv_counts, send_counts, self.group))
        received_ids = waited(funcol.all_to_all_single(local_ids, recv_counts, send_counts, self.group))
        return RoutedTokens(received, received_ids, order, send_counts, recv_counts, num_tokens, top_k)

    def combine(self, expert_out: torch.Tensor, routed: RoutedTokens, weights: torch.Tensor) -> torch.Tensor:
        """Return ``expert_out[R, H]`` to the tokens it came from and sum each token's ``K``
        results with ``weights[T, K]``: ``[T, H]``."""
        if expert_out.size(0) != routed.tokens.size(0):
            raise ValueError(f"expert_out has {expert_out.size(0)} rows, but {routed.tokens.size(0)} tokens were routed here")
        if tuple(weights.shape) != (routed.num_tokens, routed.top_k):
            raise ValueError(f"weights must be [{routed.num_tokens}, {routed.top_k}], got {tuple(weights.shape)}")
        returned = waited(funcol.all_to_all_single_autograd(expert_out, routed.send_counts, routed.recv_counts, self.group))
        # Row i of `returned` answers the (token, choice) pair routed.order[i]: put it back in place.
        unsorted = returned.index_select(0, torch.argsort(routed.order))
        hidden = unsorted.size(-1)
        return (unsorted.view(routed.num_tokens, routed.top_k, hidden) * weights.unsqueeze(-1).to(unsorted.dtype)).sum(dim=1)
