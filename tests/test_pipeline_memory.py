"""Step memory under a pipeline: each rank's stages traced through torch's own schedule, held to
within 1% of the peak the CPU allocator records in a real pipelined step on every rank of a gloo
world (``step_memory_checks.pipelined_demo_step_peaks``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from step_memory_checks import demo_units, hf_pipelined_estimate, hf_transformer, traced

from meshbind import GPUS, Cluster, LayoutContext, StepMemory, resolve_plan, step_memory, step_memory_and_comms, step_time
from meshbind.cli import main
from meshbind.errors import PipelineError, StepMemoryError
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.launch import run_local_world
from meshbind.pipeline import Pipeline
from meshbind.pipeline.schedules import Schedule, schedule_named
from meshbind.resolution.plan import ParallelPlan

LAYERS, SEQ_LEN, MICROBATCHES = 4, 32, 4
H100 = Cluster(GPUS["H100-SXM"])
BATCH = MICROBATCHES
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
RUNS = [(schedule, MICROBATCHES, checkpointing) for schedule in SCHEDULES for checkpointing in ("none", "full")]
# Schedules that split each backward into input gradients, then weight gradients (autograd.grad
# from the stage's outputs, then from what it kept for the weights).
RUNS += [
    (schedule, MICROBATCHES, checkpointing)
    for schedule in ("DualPipeV", "InterleavedZeroBubble")
    for checkpointing in ("none", "full")
]


def planned_demo(axes: dict[str, int], layers: int = LAYERS) -> tuple[Callable[[], MoETransformer], ParallelPlan]:
    """The demo's model factory (``layers`` blocks) and its plan at ``axes``, FSDP over ``dp_shard``."""

    def build() -> MoETransformer:
        return MoETransformer(TransformerConfig(layers=layers))

    with torch.device("meta"):
        model = build()
    units = demo_units(axes["dp_shard"], None)
    return build, resolve_plan(model, [loss_head_request()], LayoutContext(axes), fully_shard=units, index=True)


def pipelined_demo(
    axes: dict[str, int],
    schedule: str,
    checkpointing: str = "none",
    layers: int = LAYERS,
    microbatches: int = MICROBATCHES,
    **settings: Any,
) -> StepMemory:
    """``step_memory`` of the demo's model (4 blocks) at ``axes`` under ``schedule``, a sequence per microbatch."""
    build, plan = planned_demo(axes, layers)
    pipeline = Pipeline(schedule=schedule, microbatches=microbatches)
    return step_memory(
        build,
        plan,
        batch=microbatches,
        seq_len=SEQ_LEN,
        device="cpu",
        activation_checkpointing=checkpointing,
        pipeline=pipeline,
        **settings,
    )


def axes_of(dp_shard: int) -> dict[str, int]:
    return {"pp": 2, "dp_replicate": 1, "dp_shard": dp_shard, "cp": 1, "tp": 1, "ep": 1}


@pytest.mark.parametrize("dp_shard", [1, 2], ids=["pp2", "pp2 dp_shard2"])
def test_pipelined_estimate_is_within_a_hundredth_of_every_rank_measured(dp_shard: int) -> None:
    axes = axes_of(dp_shard)
    size = LayoutContext(axes).world.size
    target = "step_memory_checks:pipelined_demo_step_peaks"
    measured = run_local_world(size, target, axes, LAYERS, BATCH, SEQ_LEN, RUNS, timeout=300)
    errors = {}
    for index, (schedule, _, checkpointing) in enumerate(RUNS):
        estimate = pipelined_demo(axes, schedule, checkpointing)
        by_rank = {c.first_rank + offset: c.peak_bytes for c in estimate.classes for offset in range(c.ranks)}
        errors.update({(schedule, checkpointing, rank): by_rank[rank] / measured[rank][index] - 1 for rank in range(size)})
    beyond = {key: f"{error:+.4f}" for key, error in errors.items() if abs(error) > 0.01}
    assert not beyond, beyond
    # Under torch's runtime (every multi-stage schedule) a stage frees what it lets go of (an output
    # once its send is waited, what a split backward kept once the weights' gradients are done)
    # where the real step frees it: exact to a ten-thousandth on every rank.
    runtime = {key: error for key, error in errors.items() if not schedule_named(key[0]).single_stage}
    assert runtime and all(abs(error) <= 1e-4 for error in runtime.values()), runtime


@pytest.mark.parametrize(
    ("axes", "units"),
    [({"pp": 2}, None), ({"pp": 2, "dp_shard": 2, "tp": 2}, ("model.layers.*",))],
    ids=["pp2", "pp2 dp_shard2 tp2"],
)
def test_a_pipelined_transformers_model_is_within_a_hundredth_of_every_rank_measured(
    axes: dict[str, int], units: tuple[str, ...] | None
) -> None:
    """A small Llama (four layers) under 1F1B, its own TP plan and FSDP inside each stage, the
    stages made runnable by ``hf_stage``, the loss the cross entropy of the logits."""
    from meshbind import FullyShard

    fully_shard = FullyShard(units) if units else None
    by_rank = hf_pipelined_estimate(axes, fully_shard)
    size = LayoutContext(axes).world.size
    measured = run_local_world(size, "step_memory_checks:hf_pipelined_step_peak", "llama", axes, fully_shard, 8, 64, timeout=300)
    errors = {rank: f"{by_rank[rank] / peak - 1:+.4f}" for rank, peak in enumerate(measured)}
    assert all(abs(by_rank[rank] / peak - 1) <= 0.01 for rank, peak in enumerate(measured)), errors


def test_a_tp_trace_after_a_pipelined_one_in_the_same_process_keeps_to_its_own_world() -> None:
    """DTensor caches each op's sharding by meshes that compare equal over the same ranks whatever
    their groups: without each fake world clearing it, the later trace's outputs would carry the
    pipelined world's mesh, whose groups no longer exist."""
    from meshbind import FullyShard
    from meshbind.interop.hf_plans import from_hf_plan

    fully_shard = FullyShard(("model.layers.*",))
    hf_pipelined_estimate({"pp": 2, "dp_shard": 2, "tp": 2}, fully_shard)
    with torch.device("meta"):
        plan_source = from_hf_plan(hf_transformer("llama"))
    context = LayoutContext({"dp_shard": 2, "tp": 2})
    answer = traced(
        lambda: hf_transformer("llama"), plan_source, context, batch=2, seq_len=64, fully_shard=fully_shard, device="cpu"
    )
    assert answer.peak_bytes > 0


def test_the_last_stage_keeps_no_microbatchs_output_as_torchtitans_step_does() -> None:
    """torchtitan steps the schedule with ``return_outputs=False``, and so does the step both the
    trace and the truth run (``pipelined_training_step``): torch's default keeps each microbatch's
    output (a head's logits) on the last stage until the step ends, to merge them."""
    assert run_local_world(1, "pipeline_checks:outputs_kept_by_the_last_stage", timeout=60) == [0]


def test_each_pipeline_rank_is_its_own_class_and_the_peak_names_the_schedules_action() -> None:
    answer = pipelined_demo(axes_of(2), "1F1B")
    assert [(c.first_rank, c.ranks, c.stages) for c in answer.classes] == [(0, 2, (0,)), (2, 2, (1,))]
    first, last = answer.classes
    # 1F1B: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3; two microbatches in flight from action 2 on.
    assert first.peak_action.startswith("action ") and ": stage 0 " in first.peak_action
    assert int(first.peak_action.split()[1].rstrip(":")) >= 2
    assert ": stage 1 " in last.peak_action
    assert first.live_at_peak["activations"] > last.live_at_peak["activations"]
    text = answer.text()
    assert "pipeline: 2 stages, 1F1B, 4 microbatches of 1" in text and first.peak_action in text
    as_json = answer.to_dict()
    assert as_json["pipeline"]["schedule"] == "1F1B" and as_json["rank_classes"][0]["stages"] == [0]
    assert as_json["rank_classes"][1]["peak_action"] == last.peak_action
    gpipe = pipelined_demo(axes_of(2), "GPipe").classes[0]
    assert gpipe.live_at_peak["activations"] > first.live_at_peak["activations"]  # GPipe holds all four


@pytest.mark.parametrize(
    ("schedule", "checkpointing", "pp", "dp_shard", "microbatches", "fewest"),
    [
        ("Interleaved1F1B", "full", 4, 2, 8, 3),
        ("ZBVZeroBubble", "none", 4, 2, 8, 3),
        ("InterleavedZeroBubble", "none", 2, 2, 8, 3),
        ("DualPipeV", "none", 2, 2, 12, 6),
        ("DualPipeV", "none", 6, 1, 12, None),
        ("1F1B", "full", 4, 2, 12, 6),
        ("1F1B", "selective-op", 6, 2, 6, None),
        ("GPipe", "none", 4, 2, 8, 3),
        ("GPipe", "full", 2, 2, 12, 3),
    ],
)
def test_a_rank_put_together_from_a_traced_ranks_actions_is_its_whole_trace(
    schedule: str, checkpointing: str, pp: int, dp_shard: int, microbatches: int, fewest: int | None
) -> None:
    """Over two blocks more than the schedule's stages the middle ranks hold alike stages: some are
    traced, at the fewest microbatches of the same size that give each rank a twin of every action
    (``fewest``; none fewer for DualPipeV over 12 stages, which takes no fewer than its stages), and
    every rank is put together from a traced rank's actions (``memory/composed.py``,
    ``comms/composed.py``). Every figure is the one its own whole trace at all the microbatches gives:
    the peak, each kind at it (the larger inputs the first and last stages hold; FSDP's unsharded
    gradients of a split backward named where they are made), its module, phase and action; each
    collective, the timeline event by event and the step time. Under DualPipeV a wait on a forward's
    send frees the output on some ranks and not on others (after its backward or before): its twin
    is one whose microbatch ran the same computations before it. Under a single-stage schedule
    (torch's own loop) each part holds the sends and waits up to the next action: a middle rank is
    put together from another middle rank's actions (1F1B: though each rank warms up with a
    different number of forwards), the first and last ranks from their own; under GPipe each wait
    on a forward's send, all after the last forward, releases its microbatch's output in a part of its own."""
    axes = {"pp": pp, "dp_replicate": 1, "dp_shard": dp_shard, "cp": 1, "tp": 1, "ep": 1}
    build, plan = planned_demo(axes, layers=2 * pp + 2)  # two stages a rank
    settings = dict(batch=microbatches, seq_len=SEQ_LEN, device="cpu", activation_checkpointing=checkpointing)
    pipeline = Pipeline(schedule, microbatches)
    (memory, comms), (whole_memory, whole_comms) = (
        step_memory_and_comms(build, plan, pipeline=pipeline, alike_layers=alike, **settings) for alike in (True, False)
    )
    assert all("whole" in found.traced for found in (*whole_memory.classes, *whole_comms.classes))
    fewer = f"in a step of {fewest} of its {microbatches} microbatches, put together" if fewest else "' actions, put together"
    assert all(fewer in found.traced for found in (*memory.classes, *comms.classes) if "whole" not in found.traced)
    if pp > 2:  # the middle ranks: some put together from another's actions
        assert any("whole" not in found.traced and "their own" not in found.traced for found in memory.classes)
    for found, own in zip(memory.classes, whole_memory.classes, strict=True):
        assert {**found.to_dict(), "seconds": 0, "traced": ""} == {**own.to_dict(), "seconds": 0, "traced": ""}
    for found, own in zip(comms.classes, whole_comms.classes, strict=True):
        assert found.collectives == own.collectives
        assert found.work.timelines[0].events == own.work.timelines[0].events
    assert step_time(comms, H100).to_dict() == step_time(whole_comms, H100).to_dict()


def test_what_a_pipelined_trace_cannot_run_is_refused_before_it_starts() -> None:
    with pytest.raises(ValueError, match="batch 4 does not split into 3 pipeline microbatches"):
        _with_microbatches(3)
    with pytest.raises(PipelineError, match="1F1B needs at least as many microbatches as stages"):
        _with_microbatches(1)
    with torch.device("meta"):
        model = MoETransformer(TransformerConfig(layers=LAYERS))
    flat = resolve_plan(model, [loss_head_request()], LayoutContext({**axes_of(1), "pp": 1}), index=True)
    with pytest.raises(ValueError, match="pipeline is for a plan with pp above 1"):
        step_memory(lambda: MoETransformer(TransformerConfig(layers=LAYERS)), flat, batch=2, seq_len=8, pipeline=Pipeline())
    with pytest.raises(ValueError, match="inputs is not taken under a pipeline"):
        pipelined_demo(axes_of(1), "1F1B", inputs=lambda batch, seq_len: ((), {}))
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        with pytest.raises(ValueError, match=f"{schedule} runs each backward in two .* selective-op checkpointing allows one"):
            pipelined_demo(axes_of(2), schedule, "selective-op")


def test_a_split_backward_under_selective_op_checkpointing_is_refused_by_torch_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rule above is torch's: traced past it, torch refuses the weights' backward.
    monkeypatch.setattr(Schedule, "checkpointing_problem", lambda self, checkpointing: None)
    with pytest.raises(StepMemoryError, match="Trying to backward an extra time"):
        pipelined_demo(axes_of(2), "DualPipeV", "selective-op")
    assert pipelined_demo(axes_of(2), "DualPipeV", "full").peak_bytes > 0


def _with_microbatches(microbatches: int) -> StepMemory:
    def build() -> MoETransformer:
        return MoETransformer(TransformerConfig(layers=LAYERS))

    with torch.device("meta"):
        model = build()
    plan = resolve_plan(model, [loss_head_request()], LayoutContext(axes_of(1)), index=True)
    return step_memory(build, plan, batch=BATCH, seq_len=8, device="cpu", pipeline=Pipeline("1F1B", microbatches=microbatches))


def test_check_memory_answers_per_stage(capsys: pytest.CaptureFixture[str]) -> None:
    model = "meshbind.examples.moe_transformer:MoETransformer"
    plan = "meshbind.examples.moe_transformer:loss_head_request"
    axes = ["--axis", "pp=2", "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2"]
    memory = ["--memory", "--batch", "2", "--seq-len", "32", "--device", "cpu"]
    assert main(["check", model, plan, *axes, *memory, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)["memory"]
    assert [c["stages"] for c in answer["rank_classes"]] == [[0], [1]]
    assert answer["pipeline"]["microbatches"] == 2
    assert main(["check", model, plan, *axes, *memory, "--pp-microbatches", "2", "--pp-schedule", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages, GPipe, 2 microbatches of 1" in out and "ranks 4-7: peak" in out
    assert main(["check", model, plan, *axes, "--memory", "--batch", "3", "--seq-len", "32"]) == 2
    assert "batch 3 does not split into 2 pipeline microbatches" in capsys.readouterr().err
