"""FSDP2's per-rank chunks of a parameter, made only for the rank traced.

``fully_shard`` cuts each parameter with ``_chunk_with_empty``, which builds one chunk for every
rank of the shard group and reads two of them (the rank's own and the first, which is always
padded). At a million ranks that is a million tensors per parameter; a trace makes the two it reads."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import overload

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param


class RankChunks(Sequence[torch.Tensor]):
    """FSDP2's ``_chunk_with_empty(tensor, count, dim)``, each chunk made when it is read: chunk i
    is ``ceil(size / count)`` long, the last non-empty one shorter, those past the end empty."""

    def __init__(self, tensor: torch.Tensor, count: int, dim: int) -> None:
        self.tensor, self.chunks, self.dim = tensor, count, dim
        size = tensor.size(dim)
        self.length = -(-size // count) if size else 0

    def __len__(self) -> int:
        return self.chunks

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.chunks))]
        if not -self.chunks <= index < self.chunks:
            raise IndexError(f"chunk {index} of {self.chunks}")
        index %= self.chunks
        start = index * self.length
        size = self.tensor.size(self.dim)
        if size == 0:  # torch.chunk gives an empty tensor every chunk, its other dims kept
            return self.tensor.narrow(self.dim, 0, 0)
        if start >= size:  # torch.chunk makes fewer chunks than asked: the rest are empty
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.length, size - start))


@contextmanager
def chunks_for_traced_rank() -> Iterator[None]:
    """While a step is traced, FSDP2 cuts parameters into ``RankChunks``."""
    chunk_with_empty = getattr(_fsdp_param, "_chunk_with_empty")  # noqa: B009 (torch does not export it)
    setattr(_fsdp_param, "_chunk_with_empty", RankChunks)  # noqa: B010
    try:
        yield
    finally:
        setattr(_fsdp_param, "_chunk_with_empty", chunk_with_empty)  # noqa: B010
