"""The collectives of one real training step per rank on a gloo world (``step_comms_truth``):
what ``test_step_comms.py`` holds the traced ones to."""

from __future__ import annotations

import os

from step_comms_truth import FLIGHT_RECORDER, Key, recorded_collectives
from step_memory_checks import PipelinedDemoWorld, planned_demo, planned_hf

from meshbind import FullyShard, LayoutContext
from meshbind.memory.step import training_step
from meshbind.world import DENSE_AXES, EXPERT_AXES, PIPELINE_AXIS


def axis_sizes(axes: dict[str, int]) -> dict[str, int]:
    """Every mesh axis's size, the expert mesh's too."""
    world = LayoutContext(axes).world
    dense = dict(zip(DENSE_AXES, world.dense_shape, strict=True))
    return {PIPELINE_AXIS: world.pp, **dense, **dict(zip(EXPERT_AXES, world.expert_shape, strict=True))}


def demo_step_collectives(
    axes: dict[str, int], layers: int, experts: int, batch_per_rank: int, seq_len: int, checkpointing: str
) -> dict[Key, list[int]]:
    """This rank's collectives of the demo's second training step (the first makes what a step
    makes once)."""
    os.environ.update(FLIGHT_RECORDER)
    model, optimizer, inputs = planned_demo(axes, layers, experts, batch_per_rank, seq_len, checkpointing)
    training_step(model, optimizer, inputs, {})
    return recorded_collectives(lambda: training_step(model, optimizer, inputs, {}), axis_sizes(axes))


def hf_step_collectives(
    name: str, axes: dict[str, int], fully_shard: FullyShard | None, batch_per_rank: int, seq_len: int
) -> dict[Key, list[int]]:
    """This rank's collectives of a small transformers model's second training step under its own plans."""
    os.environ.update(FLIGHT_RECORDER)
    model, optimizer, kwargs = planned_hf(name, axes, fully_shard, batch_per_rank, seq_len, "none")
    training_step(model, optimizer, (), kwargs)
    return recorded_collectives(lambda: training_step(model, optimizer, (), kwargs), axis_sizes(axes))


def pipelined_demo_step_collectives(
    axes: dict[str, int], layers: int, batch_per_rank: int, seq_len: int, schedule: str, microbatches: int
) -> dict[Key, list[int]]:
    """This rank's collectives of the pipelined demo's second step under torch's ``schedule`` (the
    first learns nothing here: the stages are given their inputs' shapes)."""
    os.environ.update(FLIGHT_RECORDER)
    step, _, _, _ = PipelinedDemoWorld(axes, layers, batch_per_rank, seq_len).planned(schedule, microbatches, "none")
    step()
    return recorded_collectives(step, axis_sizes(axes))
