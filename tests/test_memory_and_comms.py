"""One traced step, both answers: ``step_memory_and_comms`` gives what ``step_memory`` and
``step_comms`` each give alone, where the alike blocks extrapolate, where the whole model is
traced, and under pipelines whose ranks ``step_comms`` alone reads from other ranks' traces."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from step_memory_checks import demo_units, hf_transformer

from meshbind import FullyShard, LayoutContext, resolve_plan, step_comms, step_memory, step_memory_and_comms
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.interop.hf_plans import from_hf_plan
from meshbind.pipeline import Pipeline
from meshbind.steptime.cluster import GPUS, Cluster
from meshbind.steptime.estimate import step_time

H100 = Cluster(GPUS["H100-SXM"])


def _llama(layers: int, axes: dict[str, int]) -> tuple[Any, Any]:
    def build() -> Any:
        return hf_transformer("llama", layers=layers)

    with torch.device("meta"):
        model = build()
    units = FullyShard(None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return build, resolve_plan(model, from_hf_plan(model), LayoutContext(axes), fully_shard=units, index=True)


def _demo(axes: dict[str, int], layers: int = 4) -> tuple[Any, Any]:
    def build() -> MoETransformer:
        return MoETransformer(TransformerConfig(layers=layers, experts=4))

    with torch.device("meta"):
        model = build()
    units = demo_units(axes["dp_shard"], None)
    return build, resolve_plan(model, [loss_head_request()], LayoutContext(axes), fully_shard=units, index=True)


DEMO_PIPELINED = {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
CASES = {
    "alike blocks extrapolated": (lambda: _llama(8, {"dp_shard": 4, "tp": 2}), {"activation_checkpointing": "full"}, None),
    "the whole model": (lambda: _llama(3, {"dp_shard": 2, "tp": 2}), {}, None),
    "1F1B": (lambda: _demo(DEMO_PIPELINED), {}, Pipeline("1F1B", 4)),
    # each rank put together from its own actions at four of the eight microbatches
    "1F1B at fewer microbatches": (lambda: _demo(DEMO_PIPELINED), {}, Pipeline("1F1B", 8)),
    "Interleaved1F1B": (lambda: _demo(DEMO_PIPELINED), {"activation_checkpointing": "full"}, Pipeline("Interleaved1F1B", 4)),
    # all three put middle ranks together from another middle rank's actions at all eight microbatches
    "1F1B, middle ranks put together": (lambda: _demo({**DEMO_PIPELINED, "pp": 6}, layers=10), {}, Pipeline("1F1B", 8)),
    # both alone put the second rank together from the third's actions
    "Interleaved1F1B, ranks put together": (
        lambda: _demo({**DEMO_PIPELINED, "pp": 4}, layers=10),
        {"activation_checkpointing": "full"},
        Pipeline("Interleaved1F1B", 8),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_trace_answers_as_step_memory_and_step_comms_each_alone(case: str) -> None:
    planned, settings, pipeline = CASES[case]
    build, plan = planned()
    settings = dict(batch=8, seq_len=32, device="cpu", device_memory=2**30, pipeline=pipeline, **settings)
    memory, comms = step_memory_and_comms(build, plan, **settings)
    settings.pop("device_memory")
    alone_memory = step_memory(build, plan, device_memory=2**30, **settings)
    alone_comms = step_comms(build, plan, **settings)

    assert memory.settings == alone_memory.settings and comms.settings == alone_comms.settings
    assert memory.fits == alone_memory.fits
    for both, alone in zip(memory.classes, alone_memory.classes, strict=True):
        assert {**both.to_dict(), "seconds": 0} == {**alone.to_dict(), "seconds": 0}
    for both, alone in zip(comms.classes, alone_comms.classes, strict=True):
        assert (both.first_rank, both.ranks, both.collectives) == (alone.first_rank, alone.ranks, alone.collectives)
        if pipeline is None or "put together" in alone.traced:
            assert both.traced == alone.traced
    assert step_time(comms, H100).to_dict() == step_time(alone_comms, H100).to_dict()
    if case == "alike blocks extrapolated":
        assert "extrapolated" in memory.classes[0].traced and "extrapolated" in comms.classes[0].traced
    if case == "1F1B, middle ranks put together":
        for found in (memory, comms, alone_memory, alone_comms):
            assert any("' actions, put together" in c.traced for c in found.classes[1:-1])
    if case == "1F1B at fewer microbatches":
        assert all("in a step of 4 of its 8 microbatches" in found.traced for found in (*memory.classes, *comms.classes))
    if case == "Interleaved1F1B, ranks put together":
        assert "put together" in memory.classes[1].traced and "put together" in comms.classes[1].traced
