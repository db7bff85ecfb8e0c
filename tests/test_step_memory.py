"""Step memory (``step_memory``): one training step traced with fake tensors over torch's fake
process group, held to within 10% of the peak the CPU allocator records in a real step on every
rank of a gloo world (``step_memory_checks.py``)."""

from __future__ import annotations

import pytest
from step_memory_checks import DEMO_UNITS

from meshbind import LayoutContext, step_memory
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.launch import run_local_world

LAYERS, EXPERTS, SEQ_LEN = 2, 8, 32
DEMO_WORLDS = {
    "4 ranks cp2 tp2 ep2 (the demo's default)": ({"cp": 2, "tp": 2, "ep": 2}, 4),
    "8 ranks dp_shard2 cp2 tp2 ep4 (FSDP)": ({"dp_shard": 2, "cp": 2, "tp": 2, "ep": 4}, 2),
}


def demo_estimate(axes: dict[str, int], batch: int, checkpointing: str) -> int:
    estimate = step_memory(
        lambda: MoETransformer(TransformerConfig(layers=LAYERS, experts=EXPERTS)),
        [loss_head_request()],
        LayoutContext(axes),
        batch=batch,
        seq_len=SEQ_LEN,
        fully_shard=DEMO_UNITS if axes.get("dp_shard", 1) > 1 else None,
        activation_checkpointing=checkpointing,
        device="cpu",
    )
    (only,) = estimate.classes
    return only.peak_bytes


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("world", list(DEMO_WORLDS))
def test_demo_estimate_is_within_a_tenth_of_every_rank_measured(world: str, checkpointing: str) -> None:
    axes, batch = DEMO_WORLDS[world]
    estimate = demo_estimate(axes, batch, checkpointing)
    size = LayoutContext(axes).world.size
    measured = run_local_world(
        size, "step_memory_checks:demo_step_peak", axes, LAYERS, EXPERTS, batch, SEQ_LEN, checkpointing, timeout=240
    )
    errors = {rank: estimate / peak - 1 for rank, peak in enumerate(measured)}
    assert all(abs(error) <= 0.10 for error in errors.values()), (estimate, measured, errors)
