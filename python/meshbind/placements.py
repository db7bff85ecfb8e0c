"""Placement arithmetic in one place: which dimension a placement splits (a negative ``Shard(d)``
counted from the end, as torch counts it), each rank's local shape under balanced shards, and how a
named placement reads in a message. Resolution, layouts, the report and the Hugging Face plans all
use these; which dimension a ``Shard`` splits is decided once, in ``rust/rules.rs``, for them and
for the Rust checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import meshbind._core as _core
from meshbind.world import canonical_axis


def shard_dim(placement: Placement | None) -> int | None:
    """The dimension ``placement`` splits as written (possibly negative): a ``Shard``'s, or a strided
    shard's (transformers' packed projections, which torch does not make a ``Shard``); ``None`` for
    any other placement."""
    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


def split_dim(placement: Placement | None, ndim: int) -> int | None:
    """The dimension ``placement`` splits in a tensor of rank ``ndim``, from 0 (``Shard(-1)`` of a
    matrix is dimension 1); ``None`` when it splits none, or names a dimension the rank lacks."""
    dim = shard_dim(placement)
    return None if dim is None else _core.split_dim(dim, ndim)


def local_shape(shape: Sequence[int], named: Mapping[str, Placement], axes: Mapping[str, int]) -> tuple[int, ...]:
    """Each rank's shape of a tensor of ``shape`` placed by ``named`` on axes of sizes ``axes``:
    every split dimension divided by the sizes of the axes splitting it (balanced, as resolution
    requires; an axis ``axes`` lacks counts 1; ``dp`` is ``dp_replicate``)."""
    local = list(shape)
    sizes = {canonical_axis(axis): size for axis, size in axes.items()}
    for axis, placement in named.items():
        dim = split_dim(placement, len(local))
        if dim is not None:
            local[dim] //= sizes.get(canonical_axis(axis), 1)
    return tuple(local)


def fsdp_chunk_shape(local: Sequence[int], shards: int) -> tuple[int, ...]:
    """What each rank allocates of a (TP- or EP-local) tensor FSDP shards over ``shards`` ranks:
    ``torch.chunk``'s first chunk of dim 0, ``ceil(d0 / shards)`` rows, the padding every rank
    keeps so that its all-gather is even. A 0-d tensor is not sharded."""
    if not local or shards == 1:
        return tuple(local)
    return (-(-local[0] // shards), *local[1:])


def placements_text(placements: Mapping[str, Placement]) -> str:
    """A named placement as messages show it: ``{ep: S(0), cp: R}``."""
    return "{" + ", ".join(f"{axis}: {p}" for axis, p in placements.items()) + "}"
