"""The world's axes in one place, as torchtitan's ``ParallelDims``: their names, sizes
and rules, which prebuilt mesh each lives on, and each rank's coordinates. ``LayoutContext``,
``MeshContext``, resolution, layouts, FSDP and the report read them here; nothing else spells an
axis name or a mesh order.

The names are ``names.Axis`` and ``names.MeshSide``. ``pp`` is outermost (torchtitan's order):
the world is ``pp`` pipeline stages of ranks, each stage a device mesh ``dp_replicate x dp_shard
x cp x tp`` (``tp`` innermost) over its own ranks, which every other axis lives on. The expert mesh lays
``edp_replicate x edp_shard x ep`` over the same ranks (``ep`` innermost): experts borrow their
``ep`` ranks from ``dp_shard · cp · tp``, as torchtitan carves them, so ``edp_replicate`` is
``dp_replicate`` and ``edp_shard`` is ``dp_shard · cp · tp / ep`` (torchtitan's ``efsdp``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from meshbind.names import Axis, MeshSide
from meshbind.units import is_int_from

PIPELINE_AXIS = Axis.PP
"""The outermost axis: the pipeline's stages, each its own ranks."""
DENSE_AXES = (Axis.DP_REPLICATE, Axis.DP_SHARD, Axis.CP, Axis.TP)
"""The device mesh's dims within one stage, outermost first: their product is a stage's ranks."""
EXPERT_AXES = (Axis.EDP_REPLICATE, Axis.EDP_SHARD, Axis.EP)
"""The expert mesh's dims over the same ranks, outermost first."""
EXPERT_AXIS = Axis.EP
"""The axis that splits the experts (what the Rust checks' rule 5 is told)."""
AXES = (PIPELINE_AXIS, *DENSE_AXES, EXPERT_AXIS)
"""The axes a world is given; the expert mesh's data-parallel axes are derived from them."""
ALIASES = {"dp": Axis.DP_REPLICATE}
"""``dp`` is pure replication, as it always was: another name for ``dp_replicate``."""
FSDP_SHARD_AXES = (Axis.DP_SHARD, Axis.CP)
"""The dense axes FSDP shards over, flattened into one (torchtitan's ``dp_shard_cp``): a CP rank
holds the whole model, so its parameters' gradients are reduced over ``cp`` as over ``dp_shard``."""
FSDP_SHARD_MESH = "dp_shard_cp"
"""The name of the flattened ``dp_shard x cp`` dim of the device mesh."""
FSDP_AXES = {MeshSide.DEVICE: (Axis.DP_REPLICATE, *FSDP_SHARD_AXES), MeshSide.EXPERT: (Axis.EDP_REPLICATE, Axis.EDP_SHARD)}
"""Per mesh, the axes FSDP reduces a unit's gradients over: those it shards over, and those HSDP
replicates over."""
MODEL_PARALLEL_AXIS = {MeshSide.DEVICE: Axis.TP, MeshSide.EXPERT: EXPERT_AXIS}
"""Per mesh, the one axis a parameter of an FSDP unit may already be placed on."""


def canonical_axis(name: str) -> str:
    """An axis's own name: ``dp`` is ``dp_replicate``; every other name is itself."""
    return ALIASES.get(name, name)


def other_spellings(names: Iterable[str]) -> dict[str, str]:
    """For axes written as ``names``, each other name of one of them mapped to the name written
    (``{"dp": "dp_replicate"}`` for a context that writes ``dp_replicate``)."""
    spelled = {}
    for name in names:
        for alias, axis in ALIASES.items():
            if name == axis:
                spelled[alias] = name
            elif name == alias:
                spelled[axis] = name
    return spelled


@dataclass(frozen=True)
class World:
    """The size of every axis; refused on construction when they cannot make a world."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not is_int_from(size, 1):
                raise ValueError(f"the {axis!r} axis size must be an int from 1 to 2**63 - 1, got {size!r}")
        borrowed = self.dp_shard * self.cp * self.tp
        if borrowed % self.ep:
            raise ValueError(self._ep_refusal(borrowed))

    def _ep_refusal(self, borrowed: int) -> str:
        fitting = [size for size in range(1, min(borrowed, 64) + 1) if borrowed % size == 0]
        fitting_text = ", ".join(map(str, fitting)) + (" or another divisor of it" if borrowed > 64 else "")
        replicated = f"; dp_replicate={self.dp_replicate} replicates the experts, it lends them no ranks" * (
            self.dp_replicate > 1
        )
        return (
            f"ep={self.ep} does not divide dp_shard * cp * tp = {self.dp_shard} * {self.cp} * {self.tp} = {borrowed}, "
            f"the ranks experts are spread over{replicated}: use ep = {fitting_text}, or a dp_shard, cp and tp whose "
            f"product is a multiple of {self.ep}"
        )

    @classmethod
    def of(cls, axis_sizes: Mapping[str, int]) -> World:
        """The world a mapping of axis sizes names (``dp`` read as ``dp_replicate``); an axis not
        named is 1. An unknown axis, or one named twice, is a ``ValueError`` naming it."""
        sizes: dict[str, int] = {}
        for name, size in axis_sizes.items():
            axis = canonical_axis(name)
            if axis not in AXES:
                given = ", ".join(AXES)
                raise ValueError(f"{name!r} is not an axis of the world (axes: {given}; 'dp' is 'dp_replicate')")
            if axis in sizes:
                raise ValueError(f"the {axis!r} axis is given twice ('dp' is 'dp_replicate')")
            sizes[axis] = size
        return cls(**sizes)

    @property
    def size(self) -> int:
        """The number of ranks: ``pp`` stages of ``stage_size`` ranks."""
        return self.pp * self.stage_size

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage: the product of the device mesh's dims."""
        return math.prod(self.dense_shape)

    @property
    def dense_shape(self) -> tuple[int, ...]:
        """The device mesh's shape within one stage."""
        return tuple(getattr(self, axis) for axis in DENSE_AXES)

    @property
    def edp_replicate(self) -> int:
        return self.dp_replicate

    @property
    def edp_shard(self) -> int:
        return self.dp_shard * self.cp * self.tp // self.ep

    @property
    def expert_shape(self) -> tuple[int, int, int]:
        return (self.edp_replicate, self.edp_shard, self.ep)

    @property
    def fsdp_shard(self) -> int:
        """The ranks FSDP splits a dense parameter over: ``dp_shard · cp``."""
        return self.dp_shard * self.cp

    def fsdp_shard_of(self, mesh: MeshSide) -> int:
        """The ranks FSDP splits a parameter over on ``mesh``, the device or the expert side."""
        return self.edp_shard if mesh == MeshSide.EXPERT else self.fsdp_shard

    def axis_sizes(self) -> dict[str, int]:
        """Every given axis and its size, in mesh order."""
        return {axis: getattr(self, axis) for axis in AXES}

    def size_of(self, axis: str) -> int:
        """Any axis's size, the expert mesh's derived ones included (``dp`` is ``dp_replicate``)."""
        name = canonical_axis(axis)
        if name not in AXES and name not in EXPERT_AXES:
            raise ValueError(f"{axis!r} is not an axis of the world (axes: {', '.join((*AXES[:-1], *EXPERT_AXES))})")
        return int(getattr(self, name))

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s coordinate on ``pp`` and on each device-mesh axis (the last varying
        fastest), then on ``ep``, innermost of the expert mesh over the same ranks."""
        stage, in_stage = divmod(rank, self.stage_size)
        coordinates, rest = {}, in_stage
        for axis in reversed(DENSE_AXES):
            rest, coordinates[axis] = divmod(rest, getattr(self, axis))
        ordered: dict[str, int] = {PIPELINE_AXIS: stage, **{axis: coordinates[axis] for axis in DENSE_AXES}}
        ordered[Axis.EP] = in_stage % self.ep
        return ordered

    def text(self) -> str:
        return ", ".join(f"{axis}={size}" for axis, size in self.axis_sizes().items())
