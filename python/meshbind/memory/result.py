"""What a step-memory trace found: per class of alike ranks, the peak bytes of one step, what is
live at that peak by kind, where it falls, and whether it fits the device."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from meshbind.names import Checkpointing, Device, Optimizer
from meshbind.pipeline import PipelineStages
from meshbind.routing import Routing
from meshbind.units import size_text
from meshbind.world import World

KINDS = (
    "parameters",
    "unsharded_parameters",
    "gradients",
    "unsharded_gradients",
    "optimizer_state",
    "activations",
    "all_gather",
    "reduce_scatter",
    "temporaries",
    "buffers",
    "inputs",
)
"""What a byte live at the peak is. Under FSDP, ``parameters`` and ``gradients`` are each rank's
shards and the ``unsharded_`` kinds the whole tensors FSDP gathers for a unit's forward and
backward; ``all_gather`` and ``reduce_scatter`` are FSDP's communication buffers; ``temporaries``
are what backward allocates beyond gradients (the gradients of activations). What the optimizer
step allocates while it runs counts as ``optimizer_state``, as torch's trackers count it."""


@dataclass(frozen=True)
class StepSettings:
    """The step that was traced."""

    batch: int
    """Sequences per data-parallel rank."""
    seq_len: int
    optimizer: Optimizer
    activation_checkpointing: Checkpointing
    device: Device
    device_memory: int | None
    routing: Routing
    pipeline: PipelineStages | None = None
    """Under ``pp`` above 1: the stages, schedule and microbatches the step ran."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_per_rank": self.batch,
            "seq_len": self.seq_len,
            "optimizer": self.optimizer,
            "activation_checkpointing": str(self.activation_checkpointing),
            "device": self.device,
            "device_memory": self.device_memory,
            "routing": {"capacity_factor": self.routing.capacity_factor},
            **({"pipeline": self.pipeline.to_dict()} if self.pipeline is not None else {}),
        }

    def text(self, world: World) -> list[str]:
        """The step in words: its sizes, optimizer, checkpointing, routing, world and pipeline."""
        lines = [
            f"one training step on {self.device}: batch {self.batch} x seq {self.seq_len} per data-parallel rank, "
            f"optimizer {self.optimizer}, activation checkpointing {self.activation_checkpointing}, {self.routing.text()}; "
            f"world {world.text()}"
        ]
        if self.pipeline is not None:
            lines.append(
                f"pipeline: {len(self.pipeline.stages)} stages, {self.pipeline.schedule.name}, "
                f"{self.pipeline.microbatches} microbatches of {self.batch // self.pipeline.microbatches}"
            )
        return lines


@dataclass(frozen=True)
class RankClassMemory:
    """Ranks ``first_rank`` to ``first_rank + ranks - 1`` hold alike shards: one was traced."""

    first_rank: int
    ranks: int
    peak_bytes: int
    live_at_peak: Mapping[str, int]
    peak_module: str
    """The innermost module running at the peak (``"<root>"``: the model itself or none)."""
    peak_phase: str
    """``forward``, ``backward`` or ``optimizer step``."""
    traced: str
    """How: ``the whole model``, which depths of its alike blocks were traced and extrapolated, or
    which pipeline stages."""
    seconds: float
    stages: tuple[int, ...] = ()
    """Under a pipeline, the stages these ranks run."""
    peak_action: str = ""
    """Under a pipeline, the schedule's action at the peak (``action 5: stage 1 backward of microbatch 2``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "first_rank": self.first_rank,
            "ranks": self.ranks,
            "peak_bytes": self.peak_bytes,
            "live_at_peak": dict(self.live_at_peak),
            "peak_module": self.peak_module,
            "peak_phase": self.peak_phase,
            "traced": self.traced,
            "seconds": self.seconds,
            **({"stages": list(self.stages), "peak_action": self.peak_action} if self.stages else {}),
        }


@dataclass(frozen=True)
class StepMemory:
    """``step_memory``'s answer."""

    settings: StepSettings
    world: World
    classes: tuple[RankClassMemory, ...]
    seconds: float

    @property
    def peak_bytes(self) -> int:
        """The largest peak of any rank."""
        return max(c.peak_bytes for c in self.classes)

    @property
    def fits(self) -> bool | None:
        """Whether every rank's peak fits ``device_memory`` (``None``: no device memory given)."""
        limit = self.settings.device_memory
        return None if limit is None else self.peak_bytes <= limit

    @property
    def shortfall_bytes(self) -> int:
        """How many more bytes the fullest rank needs than the device has (0 when it fits)."""
        limit = self.settings.device_memory
        return 0 if limit is None else max(0, self.peak_bytes - limit)

    def to_dict(self) -> dict[str, Any]:
        return {
            "world": self.world.axis_sizes(),
            **self.settings.to_dict(),
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
            "shortfall_bytes": self.shortfall_bytes,
            "rank_classes": [c.to_dict() for c in self.classes],
            "seconds": self.seconds,
        }

    def text(self) -> str:
        s = self.settings
        lines = s.text(self.world)
        for c in self.classes:
            who = ranks_text(c.first_rank, c.ranks)
            at = f", {c.peak_action}" if c.peak_action else ""
            lines.append(f"{who}: peak {size_text(c.peak_bytes)} in {c.peak_module} {c.peak_phase}{at}")
            lines.append(f"  traced: {c.traced}")
            live = [(kind, size) for kind, size in c.live_at_peak.items() if size]
            lines += [
                f"  {kind.replace('_', ' '):<22} {size_text(size):>12}" for kind, size in sorted(live, key=lambda kv: -kv[1])
            ]
        if s.device_memory is not None:
            if self.fits:
                lines.append(f"fits {size_text(s.device_memory)}: {size_text(s.device_memory - self.peak_bytes)} to spare")
            else:
                lines.append(
                    f"does NOT fit {size_text(s.device_memory)}: the fullest rank needs {size_text(self.shortfall_bytes)} more "
                    f"({size_text(self.peak_bytes)} at its peak)"
                )
        return "\n".join(lines)


def ranks_text(first: int, count: int) -> str:
    """``ranks 4-7``, or ``rank 4`` for one."""
    return f"ranks {first}-{first + count - 1}" if count > 1 else f"rank {first}"
