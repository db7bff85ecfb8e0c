"""Step collectives: every collective of one traced training step, held exactly (kind, mesh axes,
group size, dtype, calls, bytes) to the record of a real step on every rank of gloo worlds: torch's
profiler and c10d's flight recorder, which share no code with the trace (``step_comms_truth``)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from step_comms_truth import Key
from step_memory_checks import DEMO_UNITS, deep_demo, hf_transformer

from meshbind import FullyShard, LayoutContext, StepComms, plan_report, resolve_plan, step_comms
from meshbind.cli import main
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.launch import run_local_world
from meshbind.pipeline import Pipeline

CONFIG = TransformerConfig(layers=2, experts=4)


def by_key(comms: StepComms, rank: int) -> dict[Key, list[int]]:
    """The traced collectives of ``rank``'s class, keyed as the truth keys them."""
    found = next(c for c in comms.classes if c.first_rank <= rank < c.first_rank + c.ranks)
    return {(x.kind, x.axes, x.group_size, x.dtype): [x.count, x.bytes] for x in found.collectives}


def demo_comms(axes: dict[str, int]) -> StepComms:
    with torch.device("meta"):
        model = MoETransformer(CONFIG)
    fully_shard = DEMO_UNITS if axes.get("dp_shard", 1) > 1 else None
    plan = resolve_plan(model, [loss_head_request()], LayoutContext(axes), fully_shard=fully_shard, index=True)
    return step_comms(lambda: MoETransformer(CONFIG), plan, batch=2, seq_len=16, device="cpu")


DEMO_WORLDS = {
    "4 ranks cp2 tp2 ep2 (default)": {"cp": 2, "tp": 2, "ep": 2},
    "8 ranks dp_shard2 cp2 tp2 ep4 (FSDP)": {"dp_shard": 2, "cp": 2, "tp": 2, "ep": 4},
    "4 ranks HSDP dp_replicate2 dp_shard2 ep2": {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 2},
}


@pytest.mark.parametrize("world", DEMO_WORLDS)
def test_the_demos_collectives_are_every_ranks_real_ones(world: str) -> None:
    axes = DEMO_WORLDS[world]
    traced = demo_comms(axes)
    size = LayoutContext(axes).world.size
    real = run_local_world(size, "step_comms_checks:demo_step_collectives", axes, 2, 4, 2, 16, "none", timeout=240)
    assert sum(c.ranks for c in traced.classes) == size
    for rank, recorded in enumerate(real):
        assert by_key(traced, rank) == recorded, rank
    kinds = {key[:2] for key in recorded}
    assert ("all-to-all", ("ep",)) in kinds
    if axes.get("cp", 1) > 1:
        assert {("all-reduce", ("tp",)), ("all-gather", ("cp",)), ("reduce-scatter", ("cp",))} <= kinds
    if axes.get("cp", 1) > 1 and "dp_shard" in axes:  # FSDP's units over dp_shard and cp together, the experts' over edp_shard
        assert {("all-gather", ("dp_shard", "cp")), ("reduce-scatter", ("edp_shard",))} <= kinds
    if axes.get("dp_replicate", 1) > 1:  # HSDP: each unit's reduce-scattered gradients all-reduced across the replicas
        units = recorded[("reduce-scatter", ("dp_shard",), 2, "float32")][0]
        assert recorded[("all-reduce", ("dp_replicate",), 2, "float32")][0] > units


HF_WORLDS: dict[str, tuple[str, dict[str, int], FullyShard]] = {
    "llama dp_shard2 tp2 bf16/fp32": (
        "llama",
        {"dp_shard": 2, "tp": 2},
        FullyShard(("model.layers.*",), param_dtype="bf16", reduce_dtype="fp32"),
    ),
    "qwen3_moe ep2 edp_shard2 (FSDP)": (
        "qwen3_moe",
        {"dp_shard": 4, "ep": 2},
        FullyShard(("model.layers.*.mlp.experts", "model.layers.*")),
    ),
}


@pytest.mark.parametrize("world", HF_WORLDS)
def test_a_transformers_models_collectives_are_every_ranks_real_ones(world: str) -> None:
    from meshbind.interop.hf_plans import from_hf_plan

    name, axes, fully_shard = HF_WORLDS[world]
    with torch.device("meta"):
        model = hf_transformer(name)
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext(axes), fully_shard=fully_shard, index=True)
    traced = step_comms(lambda: hf_transformer(name), plan, batch=2, seq_len=64, device="cpu")
    size = LayoutContext(axes).world.size
    real = run_local_world(size, "step_comms_checks:hf_step_collectives", name, axes, fully_shard, 2, 64, timeout=240)
    for rank, recorded in enumerate(real):
        assert by_key(traced, rank) == recorded, rank
    if fully_shard.param_dtype is not None:  # gathered in bf16, reduced in float32
        dtypes = {(key[0], key[3]) for key in recorded if key[1] == ("dp_shard",)}
        assert {("all-gather", "bfloat16"), ("reduce-scatter", "float32")} <= dtypes


PIPELINED = {
    "pp2 dp_shard2 (FSDP), 1F1B": ({"pp": 2, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}, "1F1B", 4),
    "pp2 cp2 tp2 ep2, Interleaved1F1B over 4 stages": ({"pp": 2, "cp": 2, "tp": 2, "ep": 2}, "Interleaved1F1B", 4),
}


@pytest.mark.parametrize("world", PIPELINED)
def test_a_pipelined_steps_collectives_and_sends_are_every_ranks_real_ones(world: str) -> None:
    """Each stage's sends and receives per microbatch (activations forward, their gradients
    backward) on the ``pp`` group, beside what its stages' plan runs within the stage."""
    axes, schedule, microbatches = PIPELINED[world]
    config = TransformerConfig(layers=4)
    with torch.device("meta"):
        model = MoETransformer(config)
    fully_shard = DEMO_UNITS if axes.get("dp_shard", 1) > 1 else None
    plan = resolve_plan(model, [loss_head_request()], LayoutContext(axes), fully_shard=fully_shard, index=True)
    traced = step_comms(
        lambda: MoETransformer(config), plan, batch=4, seq_len=16, device="cpu", pipeline=Pipeline(schedule, microbatches)
    )
    size = LayoutContext(axes).world.size
    real = run_local_world(
        size, "step_comms_checks:pipelined_demo_step_collectives", axes, 4, 4, 16, schedule, microbatches, timeout=240
    )
    for rank, recorded in enumerate(real):
        assert by_key(traced, rank) == recorded, rank
        assert {("send", ("pp",)), ("receive", ("pp",))} <= {key[:2] for key in recorded}


@pytest.mark.parametrize("world", ["4 ranks cp2 tp2 ep2 (default)", "8 ranks dp_shard2 cp2 tp2 ep4 (FSDP)"])
def test_alike_layers_traced_at_three_depths_give_the_whole_models_collectives(world: str) -> None:
    axes = DEMO_WORLDS[world]
    with torch.device("meta"):
        model = deep_demo()
    fully_shard = DEMO_UNITS if axes.get("dp_shard", 1) > 1 else None
    plan = resolve_plan(model, [loss_head_request()], LayoutContext(axes), fully_shard=fully_shard, index=True)
    answers = [step_comms(deep_demo, plan, batch=2, seq_len=16, device="cpu", alike_layers=alike) for alike in (True, False)]
    extrapolated, whole = ([c.collectives for c in answer.classes] for answer in answers)
    assert extrapolated == whole
    assert answers[0].classes[0].traced == "3, 4 and 5 of the 8 alike blocks of blocks, extrapolated (exact)"
    assert answers[1].classes[0].traced == "the whole model"


def test_a_group_over_a_million_ranks_is_named_without_visiting_them_one_by_one() -> None:
    """FSDP's group over ``dp_shard`` and ``cp`` flattened across a million ranks is named by the
    axes its ranks differ on, and each unit's gather carries every rank's padded chunk."""
    from test_step_memory import TinyLM

    with torch.device("meta"):
        model = TinyLM()
    plan = resolve_plan(model, [], LayoutContext({"dp_shard": 500_000, "cp": 2}), index=True)
    (only,) = step_comms(TinyLM, plan, batch=1, seq_len=8, device="cpu").classes
    assert only.ranks == 10**6
    gathered, reduced = only.collectives
    assert (gathered.kind, gathered.axes, gathered.group_size, gathered.count) == ("all-gather", ("dp_shard", "cp"), 10**6, 1)
    assert (reduced.kind, reduced.axes, reduced.bytes) == ("reduce-scatter", ("dp_shard", "cp"), gathered.bytes)
    parameters = len(list(TinyLM().parameters()))
    assert gathered.bytes >= 10**6 * parameters * 4  # each shorter than the world: a padded row per rank


def test_the_answer_in_words_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    model = "meshbind.examples.moe_transformer:MoETransformer"
    plan = "meshbind.examples.moe_transformer:loss_head_request"
    axes = ["--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2"]
    flags = ["--comms", "--batch", "2", "--seq-len", "16", "--device", "cpu"]
    assert main(["check", model, plan, *axes, *flags]) == 0
    out = capsys.readouterr().out
    assert "collectives of one training step on cpu: batch 2 x seq 16 per data-parallel rank" in out
    assert "ranks 0-3:" in out
    assert "all-to-all      ep (2 ranks)            " in out
    assert main(["check", model, plan, *axes, *flags, "--json"]) == 0
    answer: dict[str, Any] = json.loads(capsys.readouterr().out)
    first = answer["comms"]["rank_classes"][0]
    assert set(first["collectives"][0]) == {"kind", "axes", "group_size", "dtype", "count", "bytes"}
    assert first["ranks"] == 4 and answer["comms"]["world"]["cp"] == 2
    assert main(["check", model, plan, *axes, "--comms"]) == 2
    assert "--comms needs --batch" in capsys.readouterr().err
    assert main(["check", model, plan, "--axis", "pp=2", *axes, *flags, "--pp-microbatches", "3"]) == 2
    assert "--comms: batch 2 does not split into 3 pipeline microbatches" in capsys.readouterr().err


def test_fsdps_collectives_move_the_reports_unit_sizes() -> None:
    """An all-gather counts its gathered output and a reduce-scatter its input (nccl-tests' sizes):
    for FSDP's units these are the report's gathered copy and reduce-scatter buffer, each unit
    gathered in forward and again in backward (the root once, kept for its backward) and reduced once."""
    axes = DEMO_WORLDS["8 ranks dp_shard2 cp2 tp2 ep4 (FSDP)"]
    with torch.device("meta"):
        model = MoETransformer(CONFIG)
    plan = resolve_plan(model, [loss_head_request()], LayoutContext(axes), fully_shard=DEMO_UNITS, index=True)
    units = plan_report(model, plan).units
    collectives = {(x.kind, x.axes): x for x in demo_comms(axes).classes[0].collectives}
    for mesh, axes_of_mesh in (("device", ("dp_shard", "cp")), ("expert", ("edp_shard",))):
        own = [unit for unit in units if unit.mesh == mesh]
        gathers = sum(unit.count * (1 if unit.fqn == "<root>" else 2) for unit in own)
        gathered = sum(unit.count * unit.gathered_bytes * (1 if unit.fqn == "<root>" else 2) for unit in own)
        reduced = sum(unit.count * unit.reduce_scatter_bytes for unit in own)
        assert (collectives[("all-gather", axes_of_mesh)].count, collectives[("all-gather", axes_of_mesh)].bytes) == (
            gathers,
            gathered,
        )
        assert collectives[("reduce-scatter", axes_of_mesh)].count == sum(unit.count for unit in own)
        assert collectives[("reduce-scatter", axes_of_mesh)].bytes == reduced
