"""Pipeline parallelism over the ``pp`` axis: the world's outermost axis, stages split as
torchtitan splits them (on meta, full FQNs kept), every schedule's needs checked before any stage
is built, the ranks' agreement on the split, and the demo trained on real gloo worlds under torch's
schedules with the loss and every gradient of one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from browser_pages import opened_page
from safetensors.torch import save_file

from meshbind import LayoutContext, resolve_plan
from meshbind.cli import main
from meshbind.demo import run as demo
from meshbind.demo.checks import FlagError, check_flags
from meshbind.demo.config import DemoConfig
from meshbind.errors import PipelineError
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.launch import run_local_world
from meshbind.model_index import ModelIndex
from meshbind.pipeline import SCHEDULES, Pipeline, split_stages, stage_model
from meshbind.pipeline.schedules import schedule_actions
from meshbind.report import plan_report
from meshbind.world import World

from hf_models import hf_model

DEMO_AXES = {"cp": 1, "tp": 1, "ep": 1}


def demo_index(layers: int = 8) -> tuple[MoETransformer, ModelIndex]:
    with torch.device("meta"):
        model = MoETransformer(TransformerConfig(layers=layers))
    plan = resolve_plan(model, [loss_head_request()], LayoutContext({"pp": 2, **DEMO_AXES}), index=True)
    assert plan.index is not None
    return model, plan.index


def test_pp_is_the_outermost_axis_of_the_world() -> None:
    world = World(pp=2, dp_shard=2, tp=2, ep=2)
    assert (world.size, world.stage_size, world.dense_shape) == (8, 4, (1, 2, 1, 2))
    assert next(iter(world.axis_sizes())) == "pp"
    # Rank 6 is the second stage's third rank: dp_shard 1, tp 0; ep counts within the stage.
    assert world.coordinates(6) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0, "ep": 0}
    assert LayoutContext({"pp": 4, "tp": 2}).world.size == 8
    with pytest.raises(ValueError, match="'pp' axis size"):
        World(pp=0)


def test_stages_split_as_torchtitan_splits_them() -> None:
    """Blocks spread evenly with the embedding and the head each weighing as one block; a
    single-stage schedule runs one stage per rank, the others two, loop-wise or in a 'v'."""
    _, index = demo_index()
    one = split_stages(index, 2, Pipeline("1F1B"))
    assert one.stages == (("embed", *(f"blocks.{i}" for i in range(4))), (*(f"blocks.{i}" for i in range(4, 8)), "norm", "head"))
    assert one.microbatches == 2 and one.stages_of_rank(1) == (1,)
    looped = split_stages(index, 2, Pipeline("Interleaved1F1B"))
    assert looped.stages == (
        ("embed", "blocks.0", "blocks.1"),
        ("blocks.2", "blocks.3", "blocks.4"),
        ("blocks.5", "blocks.6"),
        ("blocks.7", "norm", "head"),
    )
    assert looped.stages_of_rank(0) == (0, 2) and looped.stages_of_rank(1) == (1, 3)
    v = split_stages(index, 2, Pipeline("ZBVZeroBubble"))
    assert v.stages_of_rank(0) == (0, 3) and v.stages_of_rank(1) == (1, 2)
    fewer = split_stages(index, 2, Pipeline("1F1B", first_stage_less_layers=0, last_stage_less_layers=0))
    assert fewer.stages[0] == ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3")
    # 8 blocks, the embedding and the head weigh 10: 5 per stage make 2 stages, 3 make 4.
    assert len(split_stages(index, 2, Pipeline("1F1B", layers_per_stage=5)).stages) == 2
    assert len(split_stages(index, 2, Pipeline("Interleaved1F1B", layers_per_stage=3)).stages) == 4
    assert "stage 1 (pp rank 1, up to 1 microbatch in flight): blocks.4-7, norm, head" in one.text()


def test_explicit_stages_and_schedules_are_checked_and_every_problem_named() -> None:
    _, index = demo_index()
    given = (("embed", "blocks.0", "blocks.1"), ("blocks.1", "blocks.2", "nothing"))
    with pytest.raises(PipelineError) as raised:
        split_stages(index, 2, Pipeline("1F1B", stage_modules=given))
    problems = raised.value.problems
    assert "stage 1: 'nothing' is not a module of the model" in problems
    assert "'blocks.1' (stage 0) and 'blocks.1' (stage 1) overlap: each module is in one stage" in problems
    assert any(problem.startswith("no stage holds 'blocks.3.attn_norm.weight'") for problem in problems)
    with pytest.raises(PipelineError, match="1F1B needs at least as many microbatches as stages: 1 microbatches, 2 stages"):
        split_stages(index, 2, Pipeline("1F1B", microbatches=1))
    with pytest.raises(PipelineError, match="makes 16 stages, but the model has 8 blocks"):
        split_stages(index, 8, Pipeline("Interleaved1F1B"))
    with pytest.raises(PipelineError, match="runs one stage per rank, but 4 stages over pp=2 put 2"):
        split_stages(index, 2, Pipeline("GPipe", layers_per_stage=3))
    with pytest.raises(ValueError, match="must be one of GPipe, 1F1B"):
        split_stages(index, 2, Pipeline("2F2B"))
    assert set(SCHEDULES) == {
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "LoopedBFS",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
        "DualPipeV",
    }


def test_microbatches_in_flight_are_read_from_torchs_own_schedule_order() -> None:
    """Under 1F1B stage r of p holds min(p - r, m) microbatches, under GPipe all m: what torch's
    order of actions gives, not a formula meshbind keeps."""
    with torch.device("meta"):
        model = MoETransformer(TransformerConfig(layers=16))
    index = ModelIndex.of(model)
    assert split_stages(index, 4, Pipeline("1F1B", microbatches=8)).in_flight == tuple(min(4 - r, 8) for r in range(4))
    assert split_stages(index, 4, Pipeline("GPipe", microbatches=8)).in_flight == (8, 8, 8, 8)
    interleaved = split_stages(index, 4, Pipeline("Interleaved1F1B", microbatches=8))
    assert len(interleaved.in_flight) == 8 and max(interleaved.in_flight) == 8 and interleaved.in_flight[-1] == 1
    with pytest.raises(PipelineError, match="DualPipeV needs at least as many microbatches as stages: 1 microbatches, 8 stages"):
        split_stages(index, 4, Pipeline("DualPipeV", microbatches=1))


@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_the_compute_order_read_without_torchs_lowering_is_torchs_own(name: str) -> None:
    """The rules read a multi-stage schedule's compute order with torch's lowering into the
    runtime's list skipped (quadratic in the actions): the same order, the same refusals, and a
    schedule built afterwards is lowered in full."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    lower = _PipelineScheduleRuntime._prepare_schedule_with_comms
    schedule = SCHEDULES[name]
    for pp, microbatches in ((2, 2), (2, 8), (3, 6), (4, 4), (4, 16)):
        try:
            lowered = get_schedule_ops(name, pp, microbatches, 2)
        except (ValueError, AssertionError, RuntimeError):
            with pytest.raises(ValueError, match=f"torch refuses {name}"):
                schedule_actions(schedule, pp, 2 * pp, microbatches)
            continue
        assert schedule_actions(schedule, pp, 2 * pp, microbatches) == [[a for a in rank if a is not None] for rank in lowered]
    assert _PipelineScheduleRuntime._prepare_schedule_with_comms is lower


def test_a_stage_keeps_its_modules_under_their_full_fqns_and_nothing_else() -> None:
    model, index = demo_index()
    stages = split_stages(index, 2, Pipeline("Interleaved1F1B"))
    whole = dict(model.named_parameters())
    for stage, modules in enumerate(stages.stages):
        part = stage_model(model, stages.keeps(stage))
        names = [fqn for fqn, _ in part.named_parameters()]
        expected = [fqn for fqn in whole if any(fqn.startswith(f"{root}.") for root in modules)]
        assert names == expected
    last = stage_model(model, stages.keeps(3))
    assert last.embed is None and list(last.blocks._modules) == ["7"]
    assert model.embed is not None and len(model.blocks) == 8  # the whole model is left as it was


def test_a_transformers_model_splits_its_embeddings_first_and_its_norm_and_head_last() -> None:
    with torch.device("meta"):
        model = hf_model("llama", layers=4)
    stages = split_stages(ModelIndex.of(model), 2, Pipeline("1F1B"))
    assert stages.stages[0] == ("model.embed_tokens", "model.layers.0", "model.layers.1")
    assert stages.stages[1] == ("model.layers.2", "model.layers.3", "model.norm", "lm_head")
    assert stages.everywhere == ("model.rotary_emb",)  # no parameter: every stage keeps it


PIPELINED = {
    "pp2 1F1B": dict(world_size=2, pp=2, **DEMO_AXES, layers=4),
    "pp2 Interleaved1F1B": dict(world_size=2, pp=2, **DEMO_AXES, layers=4, pp_schedule="Interleaved1F1B"),
    **{
        f"pp2 {schedule}": dict(world_size=2, pp=2, **DEMO_AXES, layers=4, pp_schedule=schedule)
        for schedule in ("GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    },
    "pp2 cp2 tp2 ep2, 1F1B": dict(world_size=8, pp=2, cp=2, tp=2, ep=2, layers=4),
    "pp2 HSDP dp_replicate2 dp_shard2 ep2, 1F1B": dict(
        world_size=8, pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=1, ep=2, layers=4, batch=8
    ),
    "pp2 dp_shard2 tp2 ep2 (FSDP), Interleaved1F1B": dict(
        world_size=8, pp=2, dp_shard=2, cp=1, tp=2, ep=2, layers=4, batch=8, pp_schedule="Interleaved1F1B"
    ),
}


@pytest.mark.parametrize("layout", list(PIPELINED))
def test_the_pipelined_demo_matches_one_process(layout: str) -> None:
    config = DemoConfig(**PIPELINED[layout], dtype="float64")  # type: ignore[arg-type]
    report = demo.run_local(config)
    assert report["axis_sizes"]["pp"] == 2 and report["new_process_groups"] == 0
    assert report["max_rel_grad_diff"] <= 1e-10 and report["max_abs_loss_diff"] <= 1e-10, report
    assert report["report_matches_every_rank"]
    assert f"{config.pp_schedule}," in report["pipeline"]


def test_mixed_precision_applies_within_each_stage() -> None:
    """FSDP2's bf16/fp32 policy on each stage's units: the same bound as without a pipeline (twice
    what the casts alone move the reference; README, "Mixed precision")."""
    config = DemoConfig(world_size=4, pp=2, dp_shard=2, cp=1, tp=1, ep=2, layers=4, batch=8, param_dtype="bf16")
    report = demo.run_local(config)
    assert report["report_matches_every_rank"] and 0 < report["cast_rel_grad_diff"] < 0.5
    assert report["max_rel_grad_diff"] <= 2 * report["cast_rel_grad_diff"], report
    assert report["max_abs_loss_diff"] <= 4 * 2**-7 * abs(report["reference_loss"])


def test_the_demo_refuses_a_pipeline_it_cannot_run_before_any_process() -> None:
    refusals = {
        "--pp 2 with Interleaved1F1B makes 4 stages": dict(
            world_size=2, pp=2, **DEMO_AXES, layers=1, pp_schedule="Interleaved1F1B"
        ),
        "do not split into 3 microbatches": dict(world_size=2, pp=2, **DEMO_AXES, pp_microbatches=3),
        "--pp-schedule must be one of": dict(world_size=2, pp=2, **DEMO_AXES, pp_schedule="Zigzag"),
        "--pp 2 x --dp-replicate 1": dict(world_size=4, pp=2, **DEMO_AXES),
    }
    for message, fields in refusals.items():
        with pytest.raises(FlagError, match=message):
            check_flags(DemoConfig(**fields), cpu_count=2)  # type: ignore[arg-type]


def test_ranks_that_split_differently_all_refuse_before_any_stage_is_cut() -> None:
    outcomes = run_local_world(2, "pipeline_checks:split_with_other_microbatches", timeout=120)
    for error, parameters in outcomes:
        assert error is not None and "rank 1 differs from rank 0 first at pipeline microbatches: 4 here, 2 on rank 0" in error
        assert parameters == []


def test_check_reports_each_stage(capsys: pytest.CaptureFixture[str]) -> None:
    model = "meshbind.examples.moe_transformer:MoETransformer"
    plan = "meshbind.examples.moe_transformer:loss_head_request"
    axes = ["--axis", "pp=2", "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2"]
    assert main(["check", model, plan, *axes]) == 0
    out = capsys.readouterr().out
    assert "5 planned modules; layout pp=2, cp=2, tp=2, ep=2" in out
    assert "  stage 1 (pp rank 1, up to 1 microbatch in flight): blocks.1, norm, head" in out
    assert main(["check", model, plan, *axes, "--report", "--pp-schedule", "interleaved1f1b"]) == 0
    out = capsys.readouterr().out
    assert "ranks 0-3 (from {'pp': 0, 'dp_replicate': 0, 'dp_shard': 0, 'cp': 0, 'tp': 0, 'ep': 0}; stages 0, 2)" in out
    assert "whole on every rank of its stage, largest first:" in out
    assert main(["check", model, plan, *axes, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["pipeline"]["stages"][1] == {"modules": ["blocks.1", "norm", "head"], "pp_rank": 1, "in_flight": 1}
    assert [group["stages"] for group in answer["report"]["rank_groups"]] == [[0], [1]]
    assert main(["check", model, plan, *axes, "--pp-microbatches", "1"]) == 1
    assert "1F1B needs at least as many microbatches as stages" in capsys.readouterr().err
    with torch.device("meta"):
        demo_model = MoETransformer(TransformerConfig())
    resolved = resolve_plan(demo_model, [loss_head_request()], LayoutContext({"pp": 2, **DEMO_AXES}), index=True)
    with pytest.raises(ValueError, match="the plan has pp=2: give plan_report the pipeline's stages"):
        plan_report(demo_model, resolved)


def test_check_names_the_stage_of_each_key_a_checkpoint_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Under a pipeline the checkpoint is checked against the whole model (each stage keeps its
    modules' full FQNs), and a key it lacks or holds at another shape is named with its stage."""
    model = "meshbind.examples.moe_transformer:MoETransformer"
    plan = "meshbind.examples.moe_transformer:loss_head_request"
    axes = ["--axis", "pp=2", "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2"]
    state = {key: value.contiguous() for key, value in MoETransformer(TransformerConfig()).state_dict().items()}
    whole, short = tmp_path / "whole", tmp_path / "short"
    whole.mkdir()
    short.mkdir()
    save_file(state, str(whole / "model.safetensors"))
    lacking = {key: value for key, value in state.items() if not key.startswith("blocks.1.")}
    lacking["embed.weight"] = state["embed.weight"][:-1].contiguous()
    save_file(lacking, str(short / "model.safetensors"))
    assert main(["check", model, plan, *axes, "--checkpoint", str(whole), "--allow-unverified"]) == 0
    assert f"the checkpoint in {whole} fits the model" in capsys.readouterr().err
    assert main(["check", model, plan, *axes, "--checkpoint", str(short), "--allow-unverified"]) == 1
    err = capsys.readouterr().err
    assert "'blocks.1.attn.qkv.weight': not in the checkpoint (stage 1 holds it)" in err
    assert "'embed.weight': the checkpoint's shape" in err and "(stage 0 holds it)" in err


def test_each_stage_holds_the_bytes_of_its_own_parameters() -> None:
    """The report per pipeline rank is the whole model's rows summed over the stages it runs."""
    model, index = demo_index()
    plan = resolve_plan(model, [loss_head_request()], LayoutContext({"pp": 2, **DEMO_AXES}), index=True)
    whole = plan_report(model, resolve_plan(model, [loss_head_request()], LayoutContext(DEMO_AXES), index=True))
    for schedule in ("1F1B", "ZBVZeroBubble"):
        stages = split_stages(index, 2, Pipeline(schedule))
        report = plan_report(model, plan, pipeline=stages)
        rows = {row.fqn: row.bytes_per_rank for row in whole.params}
        for group in report.rank_groups:
            roots = [f"{root}." for stage in group.stages for root in stages.stages[stage]]
            kept = [fqn for fqn in rows if fqn.startswith(tuple(roots))]
            assert group.parameter_bytes == sum(rows[fqn] for fqn in kept)
        assert sum(group.parameter_bytes for group in report.rank_groups) == whole.rank_groups[0].parameter_bytes


def test_a_checkpoint_saved_by_a_pipeline_loads_at_other_layouts_with_the_same_loss(tmp_path: Path) -> None:
    """Saved at pp=2 · dp_shard=2 (each stage's ranks write its modules under the whole model's
    FQNs), loaded at pp=1 · dp_shard=4, at pp=4 and in one process (the reference): each gives the
    loss the saving run measured after its step; a model with blocks the checkpoint lacks is
    refused naming them, on every rank of each stage."""
    saved = tmp_path / "saved"
    common = dict(layers=4, batch=8, dtype="float64")
    first = demo.run_local(DemoConfig(world_size=4, pp=2, dp_shard=2, cp=1, tp=1, ep=2, save=str(saved), **common))  # type: ignore[arg-type]
    for layout in (dict(world_size=4, dp_shard=4, cp=1, tp=1, ep=2), dict(world_size=4, pp=4, **DEMO_AXES)):
        loaded = demo.run_local(DemoConfig(**layout, load=str(saved), **common))  # type: ignore[arg-type]
        assert abs(loaded["loss"] - first["loss_after_step"]) <= 1e-12
        assert abs(loaded["reference_loss"] - first["loss_after_step"]) <= 1e-12
        assert loaded["max_rel_grad_diff"] <= 1e-10
    deeper = DemoConfig(world_size=2, pp=2, **DEMO_AXES, layers=6, batch=8, dtype="float64", load=str(saved))
    with pytest.raises(RuntimeError, match=r"'blocks\.5\.moe\.w_gate': not in the checkpoint"):
        demo.run_local(deeper)


@pytest.mark.parametrize(
    ("name", "schedule", "tp"), [("llama", "1F1B", 1), ("qwen3_moe", "Interleaved1F1B", 1), ("llama", "1F1B", 2)]
)
def test_a_transformers_model_trains_at_pp2_with_the_loss_and_gradients_of_one_process(name: str, schedule: str, tp: int) -> None:
    """A transformers stage (``hf_stage``) under torch's schedule, with transformers' own TP plan
    inside each stage at ``tp=2``: float64, every gradient and the loss within 1e-10 of the whole
    model run in one process."""
    worst = run_local_world(2 * tp, "pipeline_checks:hf_pipelined", name, schedule, tp, timeout=240)[0]
    assert worst is not None and worst <= 1e-10, worst


def test_the_page_shows_the_stages_each_group_of_ranks_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from selenium.webdriver.common.by import By

    page = tmp_path / "report.html"
    demo_factory = ["meshbind.examples.moe_transformer:MoETransformer", "meshbind.examples.moe_transformer:loss_head_request"]
    axes = ["--axis", "pp=2", "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2"]
    assert main(["check", *demo_factory, *axes, "--pp-schedule", "Interleaved1F1B", "--json", "--html", str(page)]) == 0
    groups = json.loads(capsys.readouterr().out)["report"]["rank_groups"]
    with opened_page(page) as driver:
        bars = driver.find_elements(By.CSS_SELECTOR, "#bars .bar")
        drawn = [
            (int(bar.get_attribute("data-first")), bar.get_attribute("data-stages"), int(bar.get_attribute("data-total")))
            for bar in bars
        ]
        assert drawn == [(group["first"], ",".join(map(str, group["stages"])), group["total_bytes"]) for group in groups]
        assert [group["stages"] for group in groups] == [[0, 2], [1, 3]]
        assert "ranks 4\u20137 (4 ranks, each the same, stages 1, 3)" in bars[1].text


def test_a_stage_whose_ranks_differ_refuses_while_the_other_stage_applies() -> None:
    outcomes = run_local_world(4, "pipeline_checks:one_stage_rank_differs", timeout=120)
    assert outcomes[:2] == [None, None]
    for error in outcomes[2:]:
        assert error is not None and "rank 3 differs from rank 2 first at plan layers.3: absent here" in error, error


def test_every_watch_of_a_runtime_step_is_called_and_the_lists_handed_back_call_none() -> None:
    """Step memory and the collectives watch one step together: each adds its hook to the rank's
    runtime list, and both are called as torch's runtime takes each action."""
    from types import SimpleNamespace

    from meshbind.pipeline.hooks import on_each_runtime_step

    schedule = SimpleNamespace(rank=1, pipeline_order_with_comms={0: ["a", "b"], 1: ["c", "d", "e"]})
    seen: list[tuple[str, int]] = []
    watches = ("memory", "comms")
    lists = [on_each_runtime_step(schedule, lambda position, who=who: seen.append((who, position))) for who in watches]
    assert lists[0] == lists[1] == {0: ["a", "b"], 1: ["c", "d", "e"]} and not seen
    assert list(schedule.pipeline_order_with_comms[1]) == ["c", "d", "e"]
    assert seen == [(who, position) for position in range(3) for who in watches]
    assert on_each_runtime_step(SimpleNamespace(rank=0, pipeline_order_with_comms={}), lambda _: None) is None


def test_ranks_to_trace_are_chosen_from_lists_lowered_ahead_and_a_trace_that_ran_others_is_refused() -> None:
    """torch lowers a multi-stage schedule's runtime lists from the schedule alone: the lists read
    before any trace are the ones a traced rank runs (the traces check each), and a traced rank
    whose runtime ran other lists stops the answer rather than putting ranks together from it."""
    from meshbind.pipeline.alike import stage_signatures
    from meshbind.pipeline.runtime import (
        RankActions,
        lowered_orders,
        single_stage_orders,
        traced_and_put_together,
        with_fewer_microbatches,
    )

    _, index = demo_index()
    stages = split_stages(index, 2, Pipeline("Interleaved1F1B"))
    orders = lowered_orders(stages)
    kinds = {str(action.computation_type.value) for actions in orders.values() for action in actions}
    assert {"F", "B", "SEND_F", "RECV_B", "UNSHARD", "REDUCE_GRAD"} <= kinds  # the runtime's, not the compute order
    actions = RankActions(stages, stage_signatures(index, stages), orders)
    places = [(0, 0, 1), (1, 0, 1)]

    def answered(ran: dict[int, list[object]]) -> list[tuple[int, int]]:
        def answer(_: int, source: int, __: list[int] | None, traced: int) -> tuple[int, int]:
            return source, traced

        return traced_and_put_together(places, actions, lambda p: (p, ran), answer, lambda p: f"tracing rank {p}")

    assert answered(orders) == [(0, 0), (1, 1)]  # the two ranks hold unlike stages: each traced
    with pytest.raises(RuntimeError, match="tracing rank 0: torch ran other lists of actions"):
        answered({rank: ranks[:-1] for rank, ranks in orders.items()})

    # 1F1B runs torch's own loop: each traced rank's step gives the actions it ran, which must be
    # the order read ahead (at the fewer microbatches it is traced at).
    one_stage = split_stages(index, 2, Pipeline("1F1B", microbatches=8))
    loop = with_fewer_microbatches(
        RankActions(one_stage, stage_signatures(index, one_stage), single_stage_orders(one_stage), single_stage=True)
    )
    assert loop.traced is not None and loop.traced_orders == single_stage_orders(loop.traced.stages)

    def ran_own(lists: dict[int, list[object]]) -> list[tuple[int, list[int] | None]]:
        def answer(_: int, source: int, taken: list[int] | None, __: int) -> tuple[int, list[int] | None]:
            return source, taken

        def trace(p: int) -> tuple[int, dict[int, list[object]]]:
            return p, {p: lists[p]}

        return traced_and_put_together(places, loop, trace, answer, lambda p: f"tracing rank {p}")

    assert [source for source, _ in ran_own(loop.traced_orders)] == [0, 1]  # each from its own trace
    with pytest.raises(RuntimeError, match="tracing rank 1: torch ran other lists of actions"):
        ran_own({0: loop.traced_orders[0], 1: loop.traced_orders[1][::-1]})


@pytest.mark.parametrize(
    ("schedule", "pp", "microbatches"),
    [("Interleaved1F1B", 2, 12), ("DualPipeV", 2, 12), ("ZBVZeroBubble", 4, 16), ("1F1B", 4, 16), ("GPipe", 4, 16)],
)
def test_ranks_are_traced_at_the_fewest_microbatches_that_give_each_a_twin_of_every_action(
    schedule: str, pp: int, microbatches: int
) -> None:
    """The twins of an action do not depend on the microbatches' count: the ranks of a step of many
    are traced at the fewest whose lists give every rank a twin of each of its actions, and none fewer does."""
    from dataclasses import replace

    from meshbind.pipeline.alike import stage_signatures
    from meshbind.pipeline.runtime import RankActions, lowered_orders, single_stage_orders, with_fewer_microbatches

    _, index = demo_index()
    stages = split_stages(index, pp, Pipeline(schedule, microbatches=microbatches))
    signatures = stage_signatures(index, stages)
    single = stages.schedule.single_stage  # torch's own loop: its order
    orders = single_stage_orders if single else lowered_orders
    actions = with_fewer_microbatches(RankActions(stages, signatures, orders(stages), single_stage=single))
    assert actions.traced is not None
    fewest = actions.traced.stages.microbatches
    assert fewest < microbatches and actions.traced_orders == orders(actions.traced.stages)
    for rank in range(pp):
        taken = actions.twin_positions(rank, rank)
        assert taken is not None and len(taken) == len(actions.orders[rank]) > len(actions.traced_orders[rank])
    for fewer in range(1, fewest):
        if stages.schedule.problems(pp, len(stages.stages), fewer):
            continue
        cut = replace(stages, microbatches=fewer)
        short = replace(actions, traced=RankActions(cut, signatures, orders(cut), single_stage=single), _first_twins={})
        assert any(short.twin_positions(rank, rank) is None for rank in range(pp))
    if single:  # a rank that does not both receive and send (the first stage's, the last's) twins on itself only
        edges = (0, pp - 1)
        assert all(actions.twin_positions(rank, source) is None for rank in range(pp) for source in edges if source != rank)
        assert all(actions.twin_positions(rank, source) is None for rank in edges for source in range(pp) if source != rank)
    # As few microbatches as DualPipeV takes over pp=4 leave some action without a twin: none fewer.
    four = split_stages(index, 4, Pipeline("DualPipeV", microbatches=8))
    alone = RankActions(four, stage_signatures(index, four), lowered_orders(four))
    assert with_fewer_microbatches(alone) is alone
