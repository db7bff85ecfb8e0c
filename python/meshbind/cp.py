"""Context parallelism over a one-dimensional mesh: head-tail load-balanced sequence
sharding, its inverse, the global positions of local tokens, and an all-gather for keys and values.

With causal attention the cost of a token grows with its position, so the sequence is cut into
``2 * size`` chunks and rank ``r`` keeps chunks ``r`` and ``2 * size - 1 - r``: every rank holds one
cheap and one expensive chunk.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from meshbind.mesh import one_dimensional, waited


class CPContext:
    """Context-parallel resources over a one-dimensional mesh: ``mesh``, ``group``, ``size``, ``rank``."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = one_dimensional(mesh, "CPContext")
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()

    def __repr__(self) -> str:
        return f"CPContext(rank={self.rank}, size={self.size})"

    def _chunk(self, seq_len: int) -> int:
        chunks = 2 * self.size
        if seq_len % chunks:
            raise ValueError(f"a sequence of length {seq_len} cannot be split into 2 * cp = {chunks} equal chunks")
        return seq_len // chunks

    def positions(self, seq_len: int, *, rank: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions of a rank's local tokens (this rank's by default), in local order."""
        chunk = self._chunk(seq_len)
        r = self.rank if rank is None else rank
        if not 0 <= r < self.size:
            raise ValueError(f"rank {r} is not in the cp group of size {self.size}")
        head = torch.arange(r * chunk, (r + 1) * chunk, device=device)
        tail_start = (2 * self.size - 1 - r) * chunk
        return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])

    def gathered_positions(self, seq_len: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """The global positions of the rows ``all_gather`` returns: every rank's, in rank order."""
        return torch.cat([self.positions(seq_len, rank=r, device=device) for r in range(self.size)])

    def shard_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's two chunks of the full sequence along ``dim`` (autograd flows back to ``x``)."""
        chunk = self._chunk(x.size(dim))
        tail = 2 * self.size - 1 - self.rank
        return torch.cat([x.narrow(dim, self.rank * chunk, chunk), x.narrow(dim, tail * chunk, chunk)], dim=dim)

    def unshard_sequence(self, x_local: torch.Tensor, dim: int) -> torch.Tensor:
        """The full sequence from every rank's local part, in global order. Backward sums the
        gradient over ranks (a reduce-scatter), as an all-gather's does."""
        gathered = self.all_gather(x_local, dim)
        order = torch.argsort(self.gathered_positions(gathered.size(dim), device=x_local.device))
        return gathered.index_select(dim, order)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order; its rows sit at
        ``gathered_positions``. Backward is a reduce-scatter of the gradient."""
        if self.size == 1:
            # The identity; torch 2.15's functional all-gather over a one-rank subgroup also
            # drops the autograd edge, so it must not be called there.
            return x
        # Gathered along dim 0 and moved back: torch 2.15 gathering along another dim answers
        # with a view that drops the autograd edge when every dim before it has size 1 (a batch
        # of one sequence), and the gradient of everything before the gather is then lost.
        gathered = waited(funcol.all_gather_single_autograd(x.movedim(dim, 0).contiguous(), 0, self.group))
        return gathered.movedim(0, dim)
