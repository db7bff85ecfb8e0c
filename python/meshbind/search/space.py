"""Every layout of a cluster: the world's axes over its GPUs, and for each the pipeline schedule
and microbatches, the activation checkpointing and the mixed precision, as ``meshbind check``
takes them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from meshbind.names import ActivationCheckpointing, Checkpointing
from meshbind.pipeline.schedules import SCHEDULES, schedule_named
from meshbind.world import AXES, World

CHECKPOINTING_CHOICES = tuple(
    Checkpointing(mode)
    for mode in (ActivationCheckpointing.NONE, ActivationCheckpointing.SELECTIVE_OP, ActivationCheckpointing.FULL)
)
"""The activation checkpointing a search tries unless told: torchtitan's three modes."""
PRECISION_CHOICES = ("bf16",)
"""The parameter dtypes a search tries unless told: torchtitan's default (float32 shards, bf16
compute, fp32 reductions). Float32 compute holds more and runs at a fifteenth of the peak, so it
only joins when asked."""
REDUCE_DTYPE = "fp32"
"""Gradients are reduced in float32 under every precision, as torchtitan does."""


@dataclass(frozen=True)
class Layout:
    """One candidate: the world, its pipeline (``None`` at ``pp=1``), checkpointing and precision."""

    world: World
    schedule: str | None
    microbatches: int | None
    checkpointing: Checkpointing
    param_dtype: str

    def axes(self) -> dict[str, int]:
        """The axes above 1, in the world's order (``--axis`` for each)."""
        return {axis: size for axis, size in self.world.axis_sizes().items() if size > 1}

    def text(self) -> str:
        axes = " · ".join(f"{axis} {size}" for axis, size in self.axes().items()) or "one rank"
        pipeline = f", {self.schedule} x{self.microbatches}" if self.schedule is not None else ""
        return f"{axes}{pipeline}, ac {self.checkpointing}, {self.param_dtype}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "axes": self.world.axis_sizes(),
            "pp_schedule": self.schedule,
            "pp_microbatches": self.microbatches,
            "activation_checkpointing": str(self.checkpointing),
            "param_dtype": self.param_dtype,
            "reduce_dtype": REDUCE_DTYPE,
        }


@dataclass(frozen=True)
class Choices:
    """What a search varies besides the axes; each ``None`` is every choice (``*_CHOICES``)."""

    schedules: Sequence[str] | None = None
    microbatches: Sequence[int] | None = None
    """Microbatches per step under a pipeline; by default one per stage and one per sequence."""
    checkpointing: Sequence[str | Checkpointing] | None = None
    param_dtypes: Sequence[str] | None = None
    expert_parallel: bool | None = None
    """Whether ``ep`` above 1 is tried; by default when the model has a module named ``experts``."""

    def checked(self) -> Choices:
        """The same choices read and checked: a ``ValueError`` names the bad one."""
        schedules = tuple(schedule_named(s, "a pipeline schedule").name for s in (self.schedules or SCHEDULES))
        microbatches = None
        if self.microbatches is not None:
            bad = [m for m in self.microbatches if not isinstance(m, int) or isinstance(m, bool) or m < 1]
            if bad or not self.microbatches:
                raise ValueError(f"microbatches must be positive ints, got {list(self.microbatches)!r}")
            microbatches = tuple(sorted(set(self.microbatches)))
        checkpointing = tuple(
            dict.fromkeys(
                Checkpointing.parse(c, "activation checkpointing") for c in (self.checkpointing or CHECKPOINTING_CHOICES)
            )
        )
        dtypes = tuple(dict.fromkeys(self.param_dtypes or PRECISION_CHOICES))
        for dtype in dtypes:
            if dtype not in ("bf16", "fp32"):
                raise ValueError(f"a parameter dtype must be bf16 or fp32, got {dtype!r}")
        return Choices(schedules, microbatches, checkpointing, dtypes, self.expert_parallel)


def divisors(number: int) -> list[int]:
    """Every divisor of ``number``, ascending."""
    small = [d for d in range(1, int(number**0.5) + 1) if number % d == 0]
    return sorted({*small, *(number // d for d in small)})


def worlds(gpus: int, expert_parallel: bool) -> Iterator[World]:
    """Every world of exactly ``gpus`` ranks: each ordered split of ``gpus`` into ``pp``,
    ``dp_replicate``, ``dp_shard``, ``cp`` and ``tp``, and each ``ep`` dividing ``dp_shard · cp · tp``
    (only 1 without experts)."""
    dense = AXES[:-1]

    def splits(left: int, axes: int) -> Iterator[tuple[int, ...]]:
        if axes == 1:
            yield (left,)
            return
        for size in divisors(left):
            for rest in splits(left // size, axes - 1):
                yield (size, *rest)

    for sizes in splits(gpus, len(dense)):
        world = {str(axis): size for axis, size in zip(dense, sizes, strict=True)}
        borrowed = world["dp_shard"] * world["cp"] * world["tp"]
        for ep in divisors(borrowed) if expert_parallel else [1]:
            yield World(**world, ep=ep)


def microbatch_choices(choices: Choices, stages: int, local_batch: int) -> list[int]:
    """The microbatches tried for ``stages`` stages: those asked for, else one per stage and one
    per sequence of the local batch."""
    if choices.microbatches is not None:
        return list(choices.microbatches)
    return sorted({stages, local_batch})
