"""What a step time found: per class of alike ranks, its computation, its waits on collectives by
the axes of their groups, a pipeline's bubble and its step; and the step, tokens per second per
GPU and MFU of the whole job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshbind.comms.result import RankClassComms
from meshbind.memory.result import StepSettings, ranks_text
from meshbind.steptime.cluster import Cluster
from meshbind.steptime.price import Spent
from meshbind.world import World


@dataclass(frozen=True)
class RankClassTime:
    """Seconds of one step on ranks ``first_rank`` to ``first_rank + ranks - 1``:
    ``step = compute + sum(exposed) + bubble``."""

    first_rank: int
    ranks: int
    compute: float
    """The operators' own time (the roofline)."""
    exposed: dict[str, float]
    """The time the computation waited on collectives, by their group's axes (``dp_shard·cp``)."""
    hidden: float
    """Collectives' time that ran beside the computation and was not waited on."""
    bubble: float
    """A pipeline rank's wait for other stages (their work and their sends)."""
    step: float

    @staticmethod
    def of(traced: RankClassComms, spent: Spent, bubble: float) -> RankClassTime:
        exposed = dict(sorted(spent.exposed.items(), key=lambda item: -item[1]))
        return RankClassTime(traced.first_rank, traced.ranks, spent.compute, exposed, spent.hidden, bubble, spent.total + bubble)

    def to_dict(self) -> dict[str, Any]:
        return {
            "first_rank": self.first_rank,
            "ranks": self.ranks,
            "compute_s": self.compute,
            "exposed_s": self.exposed,
            "hidden_s": self.hidden,
            "bubble_s": self.bubble,
            "step_s": self.step,
        }


@dataclass(frozen=True)
class StepTime:
    """``step_time``'s answer."""

    settings: StepSettings
    world: World
    cluster: Cluster
    classes: tuple[RankClassTime, ...]
    step: float
    """The slowest class's step: every rank waits for the others at its collectives."""
    tokens_per_second_per_gpu: float
    """torchtitan's figure: a data-parallel rank's tokens per step over the step and its
    ``cp · tp · pp`` GPUs."""
    flops_per_token: int | None
    mfu: float | None
    """torchtitan's MFU: ``flops_per_token`` times tokens per second per GPU over the GPU's bf16 peak."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster.to_dict(),
            "step_s": self.step,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "flops_per_token": self.flops_per_token,
            "mfu": self.mfu,
            "rank_classes": [c.to_dict() for c in self.classes],
        }

    def text(self) -> str:
        mfu = f", MFU {self.mfu:.1%}" if self.mfu is not None else ", MFU unknown (the model's attention width is not known)"
        lines = [
            f"step time on {self.cluster.text()}",
            f"step {_seconds(self.step)}, {self.tokens_per_second_per_gpu:,.0f} tokens/s per GPU{mfu}",
        ]
        for c in self.classes:
            parts = [f"compute {_seconds(c.compute)}"]
            parts += [f"{axes} {_seconds(seconds)}" for axes, seconds in c.exposed.items()]
            if c.bubble > 0:
                parts.append(f"bubble {_seconds(c.bubble)}")
            hidden = f"; {_seconds(c.hidden)} of collectives hidden" if c.hidden > 0 else ""
            lines.append(f"{ranks_text(c.first_rank, c.ranks)}: step {_seconds(c.step)} = {' + '.join(parts)}{hidden}")
        return "\n".join(lines)


def _seconds(value: float) -> str:
    """``1.23 s``, ``45.6 ms``, ``789 µs``."""
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} µs"
