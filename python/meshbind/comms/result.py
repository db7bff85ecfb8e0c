"""What a step-collectives trace found: per class of alike ranks, every collective of one
training step by kind, axes, group size and dtype, with its calls and bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshbind.comms.record import Collective
from meshbind.comms.timeline import TracedWork
from meshbind.memory.result import StepSettings, ranks_text
from meshbind.units import size_text
from meshbind.world import World


@dataclass(frozen=True)
class RankClassComms:
    """Ranks ``first_rank`` to ``first_rank + ranks - 1`` hold alike shards: one was traced."""

    first_rank: int
    ranks: int
    collectives: tuple[Collective, ...]
    traced: str
    """How: ``the whole model``, which depths of its alike blocks were traced and extrapolated, or
    which pipeline stages."""
    seconds: float
    work: TracedWork
    """Every operator and collective of the traced step in order, for a step time to price."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "first_rank": self.first_rank,
            "ranks": self.ranks,
            "collectives": [collective.to_dict() for collective in self.collectives],
            "traced": self.traced,
            "seconds": self.seconds,
        }


@dataclass(frozen=True)
class StepComms:
    """``step_comms``'s answer."""

    settings: StepSettings
    world: World
    classes: tuple[RankClassComms, ...]
    seconds: float
    flops_per_token: int | None = None
    """The model's FLOPs per token as torchtitan counts them for MFU (``model_flops_per_token``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "world": self.world.axis_sizes(),
            **self.settings.to_dict(),
            "rank_classes": [c.to_dict() for c in self.classes],
            "seconds": self.seconds,
        }

    def text(self) -> str:
        header = self.settings.text(self.world)
        lines = [f"collectives of {header[0]}", *header[1:]]
        for c in self.classes:
            calls = sum(collective.count for collective in c.collectives)
            total = sum(collective.bytes for collective in c.collectives)
            lines.append(f"{ranks_text(c.first_rank, c.ranks)}: {calls} calls, {size_text(total)}")
            lines.append(f"  traced: {c.traced}")
            lines += [f"  {_line(collective)}" for collective in c.collectives]
        return "\n".join(lines)


def _line(collective: Collective) -> str:
    """``all-gather      dp_shard·cp (4 ranks)        float32     9 calls   1.50 MiB``"""
    group = f"{'·'.join(collective.axes) or '-'} ({collective.group_size} rank{'s' if collective.group_size > 1 else ''})"
    calls = f"{collective.count} call{'s' if collective.count > 1 else ''}"
    return f"{collective.kind:<15} {group:<28} {collective.dtype:<9} {calls:>10} {size_text(collective.bytes):>12}"
