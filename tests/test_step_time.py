"""Step time: the traced step's arithmetic held to torch's flop counter over a real step, the
collectives' prices to nccl-tests' bus-bandwidth factors, the overlap and the pipeline's schedule
to what they must give on timelines built by hand, MFU's FLOPs per token to torchtitan's own
count, and the command line."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from step_memory_checks import hf_transformer
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from meshbind import FullyShard, LayoutContext, resolve_plan, step_comms
from meshbind.cli import main
from meshbind.comms.timeline import OPTIMIZER, Compute, Mark, Timeline, Transfer
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.memory.step import default_inputs, training_step
from meshbind.model_flops import model_flops_per_token
from meshbind.pipeline import Pipeline, PipelineStages, schedule_named
from meshbind.steptime.cluster import GPUS, Cluster, link_bytes_per_second
from meshbind.steptime.estimate import _Actions, step_time
from meshbind.steptime.price import bus_factor, priced
from meshbind.steptime.schedule import scheduled_ends

H100 = Cluster(GPUS["H100-SXM"])
GPU = H100.gpu


def test_the_traced_steps_flops_are_torchs_flop_counter_over_a_real_step() -> None:
    model = hf_transformer("llama", layers=2)
    plan = resolve_plan(model, [], LayoutContext({}), index=True)
    traced = step_comms(lambda: hf_transformer("llama", layers=2), plan, batch=2, seq_len=16, device="cpu", alike_layers=False)
    (only,) = traced.classes
    traced_flops = sum(e.flops for e in only.work.timelines[0].events if isinstance(e, Compute))
    args, kwargs = default_inputs(model)(2, 16)
    with FlopCounterMode(display=False) as counter:
        training_step(model, torch.optim.Adam(model.parameters()), args, kwargs)
    assert traced_flops == counter.get_total_flops() > 0


def test_model_flops_per_token_is_torchtitans_count() -> None:
    from torchtitan.models.utils import get_dense_model_nparams_and_flops

    model = hf_transformer("llama", layers=2)
    config = model.config
    # torchtitan finds the embedding among the model's children: the same parameters, laid out so.
    as_torchtitan_lays_it = nn.ModuleDict(
        {"embed": model.model.embed_tokens, "layers": model.model.layers, "norm": model.model.norm, "head": model.lm_head}
    )
    head_dim = config.hidden_size // config.num_attention_heads
    _, expected = get_dense_model_nparams_and_flops(
        as_torchtitan_lays_it, config.num_hidden_layers, config.num_attention_heads, 2 * head_dim, 64
    )
    assert model_flops_per_token(model, 64) == expected
    assert model_flops_per_token(nn.Linear(4, 4), 64) is None  # no layers or heads to read


@pytest.mark.parametrize(
    ("kind", "factor"),
    [("all-reduce", 2 * 7 / 8), ("all-gather", 7 / 8), ("reduce-scatter", 7 / 8), ("all-to-all", 7 / 8), ("send", 1.0)],
)
def test_a_collective_is_priced_by_nccl_tests_bus_bandwidth(kind: str, factor: float) -> None:
    assert bus_factor(kind, 8) == factor
    within = priced([Transfer(kind, ("tp",), 8, 10**9, 0, 7, False)], H100)
    across = priced([Transfer(kind, ("dp_shard",), 8, 10**9, 0, 56, False)], H100)
    if kind == "send":  # a pipeline's sends are priced by its schedule, not here
        assert within.total == across.total == 0
        return
    assert within.exposed == {"tp": pytest.approx(10**9 * factor / GPU.nvlink_bandwidth)}
    assert across.exposed == {"dp_shard": pytest.approx(10**9 * factor / link_bytes_per_second("400Gbps"))}


def test_compute_is_the_roofline_of_each_operator() -> None:
    matmul, copy = Compute(10**12, 10**6, True), Compute(0, 10**9, False)
    spent = priced([matmul, copy], H100)
    assert spent.compute == pytest.approx(10**12 / GPU.half_flops + 10**9 / GPU.memory_bandwidth)


def _unit(seconds: float) -> Compute:
    """An operator that takes ``seconds`` at the H100's bf16 peak."""
    return Compute(round(seconds * GPU.half_flops), 0, True)


def _all_gather(seconds: float) -> Transfer:
    size = round(seconds * GPU.nvlink_bandwidth / bus_factor("all-gather", 8))
    return Transfer("all-gather", ("dp_shard",), 8, size, 0, 7, True)


def test_fsdps_all_gather_hides_behind_the_unit_before_it_and_its_reduce_scatter_behind_what_follows() -> None:
    gather = _all_gather(1e-3)
    # unit 1: gathered (nothing to hide behind), computed 2 ms; unit 2: gathered while unit 1 computes.
    first, second = replace(gather, gather=1), replace(gather, gather=2)
    events = [first, Compute(0, 0, True, waits_for=1), _unit(2e-3), second, Compute(0, 0, True, waits_for=2), _unit(2e-3)]
    spent = priced(events, H100)
    assert spent.compute == pytest.approx(4e-3)
    assert spent.exposed == {"dp_shard": pytest.approx(1e-3)}  # the first all-gather only
    assert spent.hidden == pytest.approx(1e-3)
    scatter = Transfer("reduce-scatter", ("dp_shard",), 8, gather.bytes, 0, 7, True)
    waited = priced([_unit(2e-3), scatter, _unit(0.5e-3), Mark(OPTIMIZER), _unit(1e-3)], H100)
    assert waited.exposed == {"dp_shard": pytest.approx(0.5e-3)}  # the optimizer waits for the rest
    assert waited.total == pytest.approx(4e-3)


def test_a_pipeline_action_cut_from_the_timeline_still_waits_for_its_all_gather() -> None:
    timeline = Timeline()
    weight = torch.ones(4, 4)
    timeline.compute(torch.ops.aten.mm.default, (weight, weight), {}, weight @ weight)  # before the schedule
    timeline.mark("F", 0, 0)
    gathered = torch.ones(4096, 4096, dtype=torch.bfloat16)
    timeline.transfer(_all_gather(1e-3), [gathered])
    timeline.compute(torch.ops.aten.mm.default, (gathered, gathered), {}, gathered)  # the first to read it
    forward = _Actions(timeline, H100).actions[("F", 0, 0)]
    assert forward.exposed == {"dp_shard": pytest.approx(1e-3)}


def test_a_collective_the_next_operator_reads_holds_the_computation() -> None:
    all_reduce = Transfer("all-reduce", ("tp",), 8, 10**9, 0, 7, False)
    spent = priced([_unit(1e-3), all_reduce, _unit(1e-3)], H100)
    assert spent.exposed["tp"] == pytest.approx(10**9 * 2 * 7 / 8 / GPU.nvlink_bandwidth)
    assert spent.total == pytest.approx(2e-3 + spent.exposed["tp"])


def _stages(schedule: str, pp: int, microbatches: int) -> PipelineStages:
    per_rank = schedule_named(schedule).default_stages_per_rank()
    count = pp * per_rank
    return PipelineStages(pp, schedule_named(schedule), microbatches, tuple((f"s{i}",) for i in range(count)), ())


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 8), (4, 4)])
def test_a_schedule_of_equal_stages_takes_the_textbook_time(schedule: str, pp: int, microbatches: int) -> None:
    forward, backward = 1.0, 2.0
    ends = scheduled_ends(_stages(schedule, pp, microbatches), pp, lambda a: forward if a[0] == "F" else backward, lambda _: 0.0)
    # GPipe's and 1F1B's bubble: (p - 1) forwards and backwards (Narayanan et al., 2021, section 2.2).
    assert max(ends) == pytest.approx((microbatches + pp - 1) * (forward + backward))
    hop = 0.25
    slower = scheduled_ends(
        _stages(schedule, pp, microbatches), pp, lambda a: forward if a[0] == "F" else backward, lambda _: hop
    )
    # GPipe's critical path crosses each hop once forward and once back; 1F1B's steady state waits on more.
    assert max(slower) >= max(ends) + 2 * (pp - 1) * hop - 1e-9
    assert schedule != "GPipe" or max(slower) == pytest.approx(max(ends) + 2 * (pp - 1) * hop)


def test_an_interleaved_schedule_has_a_smaller_bubble() -> None:
    def seconds(action: tuple[str, int, int]) -> float:
        return 0.5 if action[0] == "F" else 1.0  # two stages per rank: half a layer's work each

    interleaved = max(scheduled_ends(_stages("Interleaved1F1B", 4, 8), 4, seconds, lambda _: 0.0))
    plain = max(scheduled_ends(_stages("1F1B", 4, 8), 4, lambda a: 1.0 if a[0] == "F" else 2.0, lambda _: 0.0))
    work = 8 * 3.0
    assert work < interleaved < plain == (8 + 3) * 3.0


def _llama(layers: int) -> nn.Module:
    return hf_transformer("llama", layers=layers)


def test_an_extrapolated_step_time_is_the_whole_models() -> None:
    with torch.device("meta"):
        model = _llama(8)
    units = FullyShard(("model.layers.*",), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = resolve_plan(model, [], LayoutContext({"dp_shard": 4}), fully_shard=units, index=True)
    deep, whole = (
        step_time(step_comms(lambda: _llama(8), plan, batch=2, seq_len=64, alike_layers=alike), H100) for alike in (True, False)
    )
    assert "extrapolated" in step_comms(lambda: _llama(8), plan, batch=2, seq_len=64).classes[0].traced
    for got, expected in zip(deep.classes, whole.classes, strict=True):
        assert got.compute == pytest.approx(expected.compute, rel=1e-9)
        assert got.step == pytest.approx(expected.step, rel=1e-9)
        assert got.exposed.keys() == expected.exposed.keys()
    assert deep.tokens_per_second_per_gpu == pytest.approx(2 * 64 / deep.step)


def test_a_step_whose_time_does_not_grow_by_equal_steps_with_depth_is_refused() -> None:
    with torch.device("meta"):
        model = _llama(8)
    plan = resolve_plan(model, [], LayoutContext({"dp_shard": 4}), fully_shard=FullyShard(("model.layers.*",)), index=True)
    comms = step_comms(lambda: _llama(8), plan, batch=2, seq_len=64)
    (traced,) = comms.classes
    shallow, deeper, deepest = traced.work.timelines
    slower = Timeline([*deepest.events, _unit(1.0)])  # the deepest trace one second more: no longer equal steps
    uneven = replace(traced, work=replace(traced.work, timelines=(shallow, deeper, slower)))
    with pytest.raises(ValueError, match=r"ranks 0\+: the step's time does not grow by equal steps"):
        step_time(replace(comms, classes=(uneven,)), H100)


def test_a_pipelined_step_adds_the_schedules_bubble() -> None:
    config = TransformerConfig(layers=4, experts=4)
    with torch.device("meta"):
        model = MoETransformer(config)
    plan = resolve_plan(model, [loss_head_request()], LayoutContext({"pp": 2, "cp": 1, "tp": 1, "ep": 1}), index=True)
    comms = step_comms(lambda: MoETransformer(config), plan, batch=4, seq_len=16, pipeline=Pipeline("1F1B", microbatches=4))
    answer = step_time(comms, H100)
    assert len(answer.classes) == 2
    for c in answer.classes:
        assert c.bubble > 0
        assert c.step == pytest.approx(c.compute + sum(c.exposed.values()) + c.bubble)
    assert answer.step == max(c.step for c in answer.classes)
    assert answer.mfu is not None and 0 < answer.mfu < 1


def _check(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, str]:
    demo = ["meshbind.examples.moe_transformer:MoETransformer", "meshbind.examples.moe_transformer:loss_head_request"]
    try:
        code = main(["check", *demo, *flags])
    except SystemExit as exit_:  # argparse's refusal of a flag's value
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_line_prints_and_carries_the_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    step = ("--comms", "--step-time", "--gpu", "h200", "--batch", "2", "--seq-len", "16", "--inter-node", "200Gbps")
    code, out, _ = _check(capsys, "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2", *step)
    assert code == 0, out
    assert "step time on H200" in out and "tokens/s per GPU" in out and "200 Gbps between nodes" in out
    code, out, _ = _check(capsys, "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2", *step, "--json")
    timed: dict[str, Any] = json.loads(out)["step_time"]
    assert timed["cluster"]["gpu"]["name"] == "H200" and timed["cluster"]["inter_node_gb_per_s"] == 25
    (only,) = timed["rank_classes"]
    assert math.isclose(only["step_s"], only["compute_s"] + sum(only["exposed_s"].values()) + only["bubble_s"])
    assert timed["tokens_per_second_per_gpu"] == pytest.approx(2 * 16 / (2 * 2) / timed["step_s"])


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--step-time", "--gpu", "H100-SXM"), "--step-time prices the step --comms traces"),
        (("--comms", "--step-time"), "--step-time needs --gpu"),
        (("--comms", "--step-time", "--gpu", "V100"), "gpu must be one of H100-SXM, H200, A100-80GB, B200, got 'V100'"),
        (("--comms", "--step-time", "--gpu", "B200", "--inter-node", "fast"), "inter-node bandwidth must be like 400Gbps"),
    ],
)
def test_the_command_line_refuses_a_step_time_it_cannot_price(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], said: str
) -> None:
    code, _, err = _check(capsys, *flags, "--batch", "2", "--seq-len", "16")
    assert code == 2
    assert said in err


def test_the_page_draws_each_rank_class_step_by_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from browser_pages import opened_page
    from selenium.webdriver.common.by import By

    page = tmp_path / "report.html"
    step = ("--comms", "--step-time", "--gpu", "H100-SXM", "--batch", "4", "--seq-len", "16", "--pp-microbatches", "4")
    axes = ("--axis", "pp=2", "--axis", "cp=1", "--axis", "tp=2", "--axis", "ep=1")
    code, out, _ = _check(capsys, *axes, *step, "--json", "--html", str(page))
    assert code == 0
    timed = json.loads(out)["step_time"]
    with opened_page(page) as driver:
        bars = driver.find_elements(By.CSS_SELECTOR, "#time .bar")
        drawn = [(int(bar.get_attribute("data-first")), int(bar.get_attribute("data-count"))) for bar in bars]
        assert drawn == [(c["first_rank"], c["ranks"]) for c in timed["rank_classes"]]
        for bar, rank_class in zip(bars, timed["rank_classes"], strict=True):
            assert float(bar.get_attribute("data-step")) == rank_class["step_s"]
            axes = {piece.get_attribute("data-axis") for piece in bar.find_elements(By.CSS_SELECTOR, ".exposed")}
            assert axes == {axis for axis, seconds in rank_class["exposed_s"].items() if seconds > 0}
            assert bar.find_elements(By.CSS_SELECTOR, ".bubble")  # two pipeline stages: each waits on the other
        assert "tokens/s per GPU" in driver.find_element(By.ID, "time-step").text


@pytest.mark.parametrize(
    ("schedule", "pp", "layers", "microbatches", "taken"),
    [
        # Stages 1 and 2 hold two blocks each: the third rank is put together from the second's
        # actions, though it warms up with one forward fewer (no rank is put together from fewer
        # microbatches: 1F1B takes pp + 2).
        ("1F1B", 4, 6, 6, {2: 1}),
        # A middle rank of a "v" whose every action has a twin on a traced rank is put together from
        # that rank's actions; the rank traced is the one that puts together the most (here the
        # fourth, traced when the second is reached: the second, third and fifth are put together from it).
        ("DualPipeV", 6, 22, 12, {1: 3, 2: 3, 4: 3}),
    ],
)
def test_pipeline_ranks_of_alike_stages_take_another_ranks_trace(
    schedule: str, pp: int, layers: int, microbatches: int, taken: dict[int, int]
) -> None:
    config = TransformerConfig(layers=layers, experts=4)
    with torch.device("meta"):
        model = MoETransformer(config)
    units = FullyShard(("blocks.*.moe", "blocks.*"))
    context = LayoutContext({"pp": pp, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1})
    plan = resolve_plan(model, [loss_head_request()], context, fully_shard=units, index=True)
    pipeline = Pipeline(schedule, microbatches=microbatches)
    shared, whole = (
        step_comms(lambda: MoETransformer(config), plan, batch=microbatches, seq_len=16, pipeline=pipeline, alike_layers=alike)
        for alike in (True, False)
    )
    found = {rank: c.traced for rank, c in enumerate(shared.classes) if "whole" not in c.traced}
    assert found.keys() == taken.keys()
    split = shared.settings.pipeline
    assert split is not None
    for rank, source in taken.items():
        theirs = ", ".join(map(str, split.stages_of_rank(source)))
        assert f"stage{'s' if ',' in theirs else ''} {theirs}'" in found[rank]
    assert [c.collectives for c in shared.classes] == [c.collectives for c in whole.classes]
    for put_together, traced in zip(shared.classes, whole.classes, strict=True):
        assert put_together.work.timelines[0].events == traced.work.timelines[0].events
    two_per_node = Cluster(GPUS["H100-SXM"], gpus_per_node=2)  # each pipeline rank's dp pair on a node of its own
    for got, expected in zip(step_time(shared, two_per_node).classes, step_time(whole, two_per_node).classes, strict=True):
        assert got == expected
