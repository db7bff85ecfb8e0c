"""The report's rows: one per parameter, one per group of alike ranks (any rank's made on
demand), and the parameters left whole."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

from meshbind.world import World


class ParameterRow(NamedTuple):
    """One parameter of the model, planned or not (unplanned: whole on every rank). A named tuple:
    a report holds one per parameter of the model."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    placements: Mapping[str, str]
    """Axis → placement as torch writes it (``S(0)``, ``R``); empty when no plan entry places it."""
    local_shape: tuple[int, ...]
    bytes_per_rank: int
    requires_grad: bool
    protocol: str | None
    """The protocol of the planned module it belongs to (``None``: not planned)."""
    fsdp_shards: int = 1
    """How many ranks FSDP splits its dim 0 over (1: not sharded by FSDP); ``local_shape`` is then
    the padded chunk each rank allocates."""

    @property
    def whole(self) -> bool:
        """Whether every rank holds all of it."""
        return self.local_shape == self.shape


@dataclass(frozen=True)
class StateBytes:
    """A rank's parameter, gradient and optimizer-state bytes."""

    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class RankGroup(StateBytes):
    """Consecutive ranks that hold the same bytes: ranks ``first`` to ``first + count - 1``; under
    a pipeline, one pipeline rank's, which runs ``stages``."""

    first: int
    count: int
    stages: tuple[int, ...] = ()


@dataclass(frozen=True)
class RankRow(StateBytes):
    """What one rank holds, by its coordinates on the axes."""

    rank: int
    coordinates: Mapping[str, int]


class RankRows(Sequence[RankRow]):
    """Every rank's row, made when read: ``len`` is the world size, ``rows[r]`` rank ``r``'s
    coordinates and bytes. Nothing is kept per rank."""

    def __init__(self, world: World, groups: Sequence[RankGroup]) -> None:
        self.world, self.groups = world, groups
        self.size = world.size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[rank] for rank in range(*index.indices(self.size))]
        rank = index + self.size if index < 0 else index
        if not 0 <= rank < self.size:
            raise IndexError(f"rank {index} is outside the world of {self.size} ranks")
        group = next(g for g in self.groups if g.first <= rank < g.first + g.count)
        return RankRow(
            group.parameter_bytes, group.gradient_bytes, group.optimizer_bytes, rank, MappingProxyType(self.coordinates(rank))
        )

    def __iter__(self) -> Iterator[RankRow]:
        return (self[rank] for rank in range(self.size))

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s coordinates (``World.coordinates``)."""
        return self.world.coordinates(rank)


@dataclass(frozen=True)
class WholeGroup:
    """Parameters that stay whole on every rank and differ only in a layer index."""

    fqn: str
    """``model.layers.<0-47>.mlp.experts.gate_up_proj`` (one FQN when alone)."""
    count: int
    bytes_each: int
    """Each one's bytes on every rank."""
