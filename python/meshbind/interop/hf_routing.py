"""transformers' expert-parallel dispatch under a step-memory trace, through transformers' own
registry of EP implementations (``EPImplementationInterface``), not a patch: ``ASSUMED_ROUTING_EP``
runs transformers' ``AllToAllEP``, except that while a trace assumes a routing the split sizes come
from that assumption instead of being read back from the routing's data."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.distributed import expert_parallel
from transformers.distributed.expert_parallel import AllToAllEP, EPImplementationInterface, _AllToAllState

from meshbind.routing import assumed_routing

ASSUMED_ROUTING_EP = "meshbind_assumed_routing"


class AssumedRoutingEP(AllToAllEP):
    """``AllToAllEP``; under an assumed routing, the pairs each rank sends and receives are the
    assumption's, and the local expert of each received row is spread evenly over the experts."""

    def _dispatch_tokens(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        routing = assumed_routing()
        if routing is None:
            return super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)  # type: ignore[no-untyped-call]
        num_tokens = hidden_states.size(0)
        if self.tp_mesh.size() > 1:  # as AllToAllEP: each TP rank sends its slice of the shared batch
            hidden_states, top_k_index, top_k_weights = (
                DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                .redistribute(self.tp_mesh, [Shard(0)])
                .to_local()
                for t in (hidden_states, top_k_index, top_k_weights)
            )
        num_top_k = top_k_index.size(-1)
        order = torch.argsort(top_k_index.reshape(-1))
        send_tokens = hidden_states[order // num_top_k]
        send_sizes, recv_sizes = routing.counts(top_k_index.numel(), self.ep_mesh.size())
        # AllToAllEP's exchange of the per-expert counts, run as it runs it, so that a traced step's
        # collectives are the real step's; what it receives is not read.
        shape = (self.ep_mesh.size(), int(self.num_local_experts))  # type: ignore[arg-type]
        send_counts = torch.zeros(shape, dtype=torch.long, device=hidden_states.device)
        torch.distributed.all_to_all_single(torch.empty_like(send_counts), send_counts, group=self.ep_mesh.get_group())
        sent = all_to_all_single_autograd(send_tokens, recv_sizes, send_sizes, self.ep_mesh.get_group())
        received = expert_parallel._WaitTensor.apply(sent)  # type: ignore[attr-defined]
        rows, local_experts = sum(recv_sizes), int(self.num_local_experts)  # type: ignore[arg-type]
        expert_ids = (torch.arange(rows, device=hidden_states.device) * local_experts // max(rows, 1)).unsqueeze(-1)
        weights = torch.ones_like(expert_ids, dtype=received.dtype)
        return received, expert_ids, weights, _AllToAllState(top_k_weights, order, send_sizes, recv_sizes, num_tokens)


EPImplementationInterface.register(ASSUMED_ROUTING_EP, AssumedRoutingEP)
