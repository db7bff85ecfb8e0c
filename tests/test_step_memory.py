"""Step memory (``step_memory``): one training step traced with fake tensors over torch's fake
process group, held to within 1% of the peak the CPU allocator records in a real step on every
rank of a gloo world (``step_memory_checks.py``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from browser_pages import opened_page
from step_memory_checks import DEMO_UNITS, demo_units, hf_transformer, traced
from torch import nn
from torch.overrides import TorchFunctionMode

from meshbind import FullyShard, LayoutContext, Routing, StepMemory, StepMemoryError, UnitPrecision, resolve_plan
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.launch import run_local_world
from meshbind.units import parse_bytes

LAYERS, EXPERTS, SEQ_LEN = 2, 8, 32
DEMO_WORLDS = {
    "4 ranks cp2 tp2 ep2 (the demo's default)": ({"cp": 2, "tp": 2, "ep": 2}, 4, "adam", "float32"),
    "8 ranks dp_shard2 cp2 tp2 ep4 (FSDP)": ({"dp_shard": 2, "cp": 2, "tp": 2, "ep": 4}, 2, "adam", "float32"),
    "4 ranks HSDP": ({"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 2}, 2, "adam", "float32"),
    "4 ranks cp2 tp2 ep2, sgd with momentum": ({"cp": 2, "tp": 2, "ep": 2}, 4, "sgd-momentum", "float32"),
    "4 ranks dp_shard2 tp2 ep2, bfloat16": ({"dp_shard": 2, "cp": 1, "tp": 2, "ep": 2}, 2, "adam", "bfloat16"),
    "4 ranks dp_shard2 tp2 ep2, bf16/fp32 mixed precision": (
        {"dp_shard": 2, "cp": 1, "tp": 2, "ep": 2},
        2,
        "adam",
        "float32",
        "bfloat16",
    ),
}


def demo_estimate(
    axes: dict[str, int],
    batch: int,
    checkpointing: str,
    optimizer: str = "adam",
    dtype: str = "float32",
    param_dtype: str | None = None,
) -> int:
    estimate = traced(
        lambda: MoETransformer(TransformerConfig(layers=LAYERS, experts=EXPERTS)).to(getattr(torch, dtype)),
        [loss_head_request()],
        LayoutContext(axes),
        batch=batch,
        seq_len=SEQ_LEN,
        fully_shard=demo_units(axes.get("dp_shard", 1), param_dtype),
        activation_checkpointing=checkpointing,
        optimizer=optimizer,
        device="cpu",
    )
    (only,) = estimate.classes
    return only.peak_bytes


MIXED_DEMO = "4 ranks dp_shard2 tp2 ep2, bf16/fp32 mixed precision"
SELECTIVE = ("selective-layer:2", "selective-op")
DEMO_CHECKPOINTING = {
    world: ("none", "full", *(SELECTIVE if world in (next(iter(DEMO_WORLDS)), MIXED_DEMO) else ())) for world in DEMO_WORLDS
}


@pytest.mark.parametrize("world", list(DEMO_WORLDS))
def test_demo_estimate_is_within_a_hundredth_of_every_rank_measured(world: str) -> None:
    """Each checkpointing mode of the world measured in turn on one gloo world."""
    axes, batch, optimizer, dtype, *mixed = DEMO_WORLDS[world]
    param_dtype = mixed[0] if mixed else None
    modes = list(DEMO_CHECKPOINTING[world])
    size = LayoutContext(axes).world.size
    measured = run_local_world(
        size,
        "step_memory_checks:demo_step_peaks",
        axes,
        LAYERS,
        EXPERTS,
        batch,
        SEQ_LEN,
        modes,
        optimizer,
        dtype,
        param_dtype,
        timeout=240,
    )
    errors = {}
    for index, checkpointing in enumerate(modes):
        estimate = demo_estimate(axes, batch, checkpointing, optimizer, dtype, param_dtype)
        errors.update({(checkpointing, rank): estimate / peaks[index] - 1 for rank, peaks in enumerate(measured)})
    beyond = {key: f"{error:+.4f}" for key, error in errors.items() if abs(error) > 0.01}
    assert not beyond, beyond


def small_estimate(axes: dict[str, int], **settings: object) -> StepMemory:
    return traced(
        lambda: MoETransformer(TransformerConfig(layers=LAYERS, experts=EXPERTS)),
        [loss_head_request()],
        LayoutContext(axes),
        seq_len=SEQ_LEN,
        **{"batch": 2, "device": "cpu", **settings},  # type: ignore[arg-type]
    )


FSDP_AXES = DEMO_WORLDS["8 ranks dp_shard2 cp2 tp2 ep4 (FSDP)"][0]


def test_what_is_live_at_the_peak_adds_up_and_names_fsdp_buffers_only_under_fsdp() -> None:
    plain = small_estimate(DEMO_WORLDS["4 ranks cp2 tp2 ep2 (the demo's default)"][0])
    sharded = small_estimate(FSDP_AXES, fully_shard=DEMO_UNITS)
    for estimate in (plain, sharded):
        (only,) = estimate.classes
        assert sum(only.live_at_peak.values()) == only.peak_bytes
        assert only.live_at_peak["parameters"] > 0 and only.live_at_peak["optimizer_state"] > 0
        assert only.live_at_peak["activations"] > 0
        assert only.peak_phase in ("forward", "backward", "optimizer step")
    assert plain.classes[0].live_at_peak["all_gather"] == 0 and plain.classes[0].live_at_peak["unsharded_parameters"] == 0
    assert sharded.classes[0].live_at_peak["unsharded_parameters"] > 0
    # The demo's experts hold most activations: the peak falls in an MoE layer's backward.
    assert plain.classes[0].peak_module.endswith(".moe") and plain.classes[0].peak_phase == "backward"


def test_every_rank_is_one_class_and_the_answer_says_whether_it_fits() -> None:
    estimate = small_estimate(FSDP_AXES, fully_shard=DEMO_UNITS, device_memory=2**20)
    (only,) = estimate.classes
    assert (only.first_rank, only.ranks) == (0, 8)
    assert estimate.fits is False and estimate.shortfall_bytes == only.peak_bytes - 2**20
    assert "does NOT fit 1.00 MiB" in estimate.text()
    roomy = small_estimate(FSDP_AXES, fully_shard=DEMO_UNITS, device_memory=2**30)
    assert roomy.fits is True and roomy.shortfall_bytes == 0
    assert roomy.to_dict()["rank_classes"][0]["peak_bytes"] == roomy.peak_bytes


def test_checkpointing_and_capacity_move_the_peak_the_way_they_must() -> None:
    base = small_estimate(FSDP_AXES, fully_shard=DEMO_UNITS).peak_bytes
    assert small_estimate(FSDP_AXES, fully_shard=DEMO_UNITS, activation_checkpointing="full").peak_bytes < 0.8 * base
    assert small_estimate(FSDP_AXES, fully_shard=DEMO_UNITS, routing=Routing(2.0)).peak_bytes > 1.2 * base
    assert small_estimate(FSDP_AXES, fully_shard=DEMO_UNITS, batch=4).peak_bytes > 1.6 * base


class DataDependent(nn.Module):
    """Reads a value to decide a shape: a fake tensor has no value to read."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8)])

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](ids.float().unsqueeze(-1).expand(*ids.shape, 8))
        keep = int((x > 0).sum())
        return x.flatten()[:keep].sum()


def test_a_model_that_cannot_be_traced_is_refused_with_the_module_and_the_reason() -> None:
    with pytest.raises(StepMemoryError) as refused:
        traced(DataDependent, [], LayoutContext({"tp": 2}), batch=1, seq_len=4, device="cpu")
    message = str(refused.value)
    assert "cannot be traced with fake tensors" in message and "forward" in message
    assert "DataDependent" in message or "<root>" in message


def test_bad_settings_are_refused_before_any_trace() -> None:
    build = lambda: MoETransformer(TransformerConfig(layers=1, experts=EXPERTS))  # noqa: E731
    for settings, words in [
        ({"batch": 0}, "batch must be a positive int"),
        ({"seq_len": 10**12}, r"seq_len 1000000000000 is over the limit of 2,147,483,647 \(2\*\*31 - 1\)"),
        ({"batch": 2**16, "seq_len": 2**16}, r"batch 65536 x seq_len 65536 is 4,294,967,296 tokens per rank"),
        ({"optimizer": "adam-fp32-master"}, "traced optimizer must be one of"),
        ({"activation_checkpointing": "selective"}, "activation_checkpointing must be one of"),
        ({"device": "tpu"}, "device must be one of"),
    ]:
        with pytest.raises(ValueError, match=words):
            traced(
                build, [loss_head_request()], LayoutContext({"cp": 1, "tp": 2, "ep": 1}), **{"batch": 1, "seq_len": 8, **settings}
            )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"capacity factor must be a number from 1\.0"):
        Routing(0.5)


def test_parse_bytes_reads_what_people_write() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30 == parse_bytes("80GB") == parse_bytes(" 80 gib ")
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1e9") == 10**9
    for bad in ("eighty", "-1GiB", "0", "inf", "nan", "1e400GiB"):
        with pytest.raises(ValueError, match="device memory"):
            parse_bytes(bad)


ROUTER_IN_FLOAT32 = UnitPrecision("model.layers.*.mlp.gate", param_dtype="fp32", output_dtype="bf16")
HF_WORLDS = {
    "llama tp2 dp_shard2": ("llama", {"dp_shard": 2, "tp": 2}, FullyShard(("model.layers.*",))),
    "qwen3_moe ep2 (balanced routing)": ("qwen3_moe", {"dp_shard": 2, "ep": 2}, None),
    "llama dp_shard4 bf16/fp32": ("llama", {"dp_shard": 4}, FullyShard(None, param_dtype="bf16", reduce_dtype="fp32")),
    "qwen3_moe ep2 edp_shard2 bf16/fp32, router fp32": (
        "qwen3_moe",
        {"dp_shard": 4, "ep": 2},
        FullyShard(
            ("model.layers.*.mlp.experts", "model.layers.*.mlp.gate", "model.layers.*"),
            param_dtype="bf16",
            reduce_dtype="fp32",
            unit_policies=(ROUTER_IN_FLOAT32,),
        ),
    ),
}
HF_CHECKPOINTING = {
    "llama tp2 dp_shard2": ("none", "full", *SELECTIVE),
    "qwen3_moe ep2 (balanced routing)": ("none", "full"),
    "llama dp_shard4 bf16/fp32": ("none",),
    "qwen3_moe ep2 edp_shard2 bf16/fp32, router fp32": ("none",),
}


@pytest.mark.parametrize("world", list(HF_WORLDS))
def test_hf_estimate_is_within_a_hundredth_of_every_rank_measured(world: str) -> None:
    """Each checkpointing mode of the world measured in turn on one gloo world."""
    from meshbind.interop.hf_plans import from_hf_plan

    name, axes, fully_shard = HF_WORLDS[world]
    modes = list(HF_CHECKPOINTING[world])
    size = LayoutContext(axes).world.size
    measured = run_local_world(size, "step_memory_checks:hf_step_peaks", name, axes, fully_shard, 2, 64, modes, timeout=240)
    with torch.device("meta"):
        plan_source = from_hf_plan(hf_transformer(name))
    errors = {}
    for index, checkpointing in enumerate(modes):
        estimate = traced(
            lambda: hf_transformer(name),
            plan_source,
            LayoutContext(axes),
            batch=2,
            seq_len=64,
            fully_shard=fully_shard,
            activation_checkpointing=checkpointing,
            device="cpu",
        ).peak_bytes
        errors.update({(checkpointing, rank): estimate / peaks[index] - 1 for rank, peaks in enumerate(measured)})
    beyond = {key: f"{error:+.4f}" for key, error in errors.items() if abs(error) > 0.01}
    assert not beyond, beyond


DEMO_CHECK = [
    "check",
    "meshbind.examples.moe_transformer:MoETransformer",
    "meshbind.examples.moe_transformer:loss_head_request",
    *("--axis", "dp_shard=2", "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=4"),
    *("--fully-shard", "blocks.*.moe", "--fully-shard", "blocks.*"),
]


def test_meshbind_check_memory_says_whether_it_fits_and_exits_1_when_not(capsys: pytest.CaptureFixture[str]) -> None:
    from meshbind.cli import main

    memory = ["--memory", "--batch", "1", "--seq-len", "32", "--device", "cpu"]
    assert main([*DEMO_CHECK, *memory, "--device-memory", "1MiB"]) == 1
    out = capsys.readouterr().out
    assert "ranks 0-7: peak" in out and "does NOT fit 1.00 MiB" in out
    assert main([*DEMO_CHECK, *memory, "--device-memory", "1GiB", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["ok"] is True and answer["memory"]["fits"] is True
    (only,) = answer["memory"]["rank_classes"]
    assert only["ranks"] == 8 and only["peak_bytes"] == answer["memory"]["peak_bytes"] > 0


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--memory", "--seq-len", "32"], "--memory needs --batch"),
        (["--memory", "--batch", "1", "--seq-len", "32", "--optimizer", "adam-fp32-master"], "traced optimizer must be one of"),
    ],
)
def test_meshbind_check_memory_refuses_what_it_cannot_trace(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshbind.cli import main

    assert main([*DEMO_CHECK, *flags]) == 2
    assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*DEMO_CHECK, "--memory", "--batch", "1", "--seq-len", "32", "--device-memory", "lots"])


def _both_ways(build: Any, requests: Any, axes: dict[str, int], **settings: Any) -> tuple[Any, Any]:
    return tuple(  # type: ignore[return-value]
        traced(build, requests, LayoutContext(axes), alike_layers=alike, **settings).classes[0] for alike in (True, False)
    )


def test_every_place_of_the_step_is_extrapolated_not_only_the_shallow_peak() -> None:
    """Where a shallow step peaks (the root's backward, say) need not be where the deep step does:
    a place whose bytes grow faster with depth (the saved inputs of every checkpointed block, at
    the start of backward) overtakes it. Each place is extrapolated, blocks of the run named as in
    the whole model (the second-to-last block at three, four and five blocks is block 18 of 20);
    a place that does not grow by equal steps makes the extrapolation refuse. Pure arithmetic here;
    a real model's extrapolation is held to its whole trace below."""
    from meshbind.memory.depth import AlikeRun, extrapolated

    run = AlikeRun("layers", 0, 20)

    def step(depth: int, root: int, block: int) -> dict[tuple[str, str, str], dict[str, int]]:
        return {
            ("<root>", "backward", ""): {"peak": root, "activations": root // 10},
            (f"layers.{depth - 2}.mlp", "backward", f"layers.{depth - 2}"): {"peak": block, "activations": block // 10},
        }

    places = [step(3, 100, 50), step(4, 110, 70), step(5, 120, 90)]
    assert [max(p.values(), key=lambda f: f["peak"])["peak"] for p in places] == [100, 110, 120]  # the root, each time
    assert extrapolated(places, run) == (
        ("layers.18.mlp", "backward", "layers.18"),
        {"peak": 50 + 17 * 20, "activations": 5 + 17 * 2},
    )
    places[2][("<root>", "backward", "")] = {"peak": 121, "activations": 12}
    assert extrapolated(places, run) is None


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective-op"])
def test_alike_layers_traced_at_three_depths_give_the_whole_models_answer(checkpointing: str) -> None:
    """Extrapolating from 3, 4 and 5 alike blocks to 8 gives exactly what tracing all 8 gives:
    the peak, every kind live at it, the module (counted from the start or from the end) and phase.
    The root's moments before, between and after its blocks are places apart: taken as one, the
    checkpointed steps' would not grow by equal steps and the whole model would be traced."""
    from meshbind.interop.hf_plans import from_hf_plan

    demo = _both_ways(
        lambda: MoETransformer(TransformerConfig(layers=8, experts=EXPERTS)),
        [loss_head_request()],
        FSDP_AXES,
        batch=2,
        seq_len=SEQ_LEN,
        fully_shard=DEMO_UNITS,
        activation_checkpointing=checkpointing,
        device="cpu",
    )
    with torch.device("meta"):
        plan_source = from_hf_plan(hf_transformer("llama", layers=8))
    llama = _both_ways(
        lambda: hf_transformer("llama", layers=8),
        plan_source,
        {"dp_shard": 2, "tp": 2},
        batch=2,
        seq_len=64,
        fully_shard=FullyShard(("model.layers.*",)),
        activation_checkpointing=checkpointing,
    )
    assert llama[0].traced == "3, 4 and 5 of the 8 alike blocks of model.layers, extrapolated (exact)"
    assert demo[0].traced == "3, 4 and 5 of the 8 alike blocks of blocks, extrapolated (exact)"
    for extrapolated, whole in (demo, llama):
        assert whole.traced == "the whole model"
        assert extrapolated.peak_bytes == whole.peak_bytes
        assert dict(extrapolated.live_at_peak) == dict(whole.live_at_peak)
        assert extrapolated.peak_phase == whole.peak_phase
        if checkpointing == "none":
            assert extrapolated.peak_module == whole.peak_module
        else:  # each block's recomputed backward reaches the same peak: any of them may be named
            assert re.sub(r"\.\d+\.", ".N.", extrapolated.peak_module) == re.sub(r"\.\d+\.", ".N.", whole.peak_module)


def test_the_alike_run_is_the_last_blocks_that_are_alike() -> None:
    from meshbind.memory.depth import alike_run
    from meshbind.model_index import ModelIndex

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.proj = nn.Linear(width, width)

    class Model(nn.Module):
        def __init__(self, widths: list[int]) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block(width) for width in widths)

    run = alike_run(ModelIndex.of(Model([4, 4, 8, 8, 8, 8, 8, 8])))  # dense blocks first, as DeepSeek-V3's
    assert run is not None and (run.list_fqn, run.first, run.count) == ("layers", 2, 6)
    assert alike_run(ModelIndex.of(Model([8] * 5))) is None  # no more blocks than the deepest trace


class NarrowAttention(nn.Module):
    """Attention whose value heads are narrower than its query and key heads (as MLA's): on the
    CPU torch runs it on its math path, which keeps the probabilities; CUDA's kernels do not."""

    HEADS, SEQ, QK, V = 4, 256, 32, 16

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, self.HEADS * (2 * self.QK + self.V))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, self.HEADS, -1).transpose(1, 2).split([self.QK, self.QK, self.V], dim=-1)
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class NarrowValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 64)
        self.blocks = nn.ModuleList([NarrowAttention()])  # what full checkpointing wraps: recomputed

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](self.embed(ids)).float().pow(2).mean()


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_a_cuda_target_keeps_no_attention_probabilities(checkpointing: str) -> None:
    def peak(device: str) -> int:
        answer = traced(
            NarrowValues,
            [],
            LayoutContext({"tp": 1}),
            batch=1,
            seq_len=NarrowAttention.SEQ,
            device=device,
            optimizer="none",
            activation_checkpointing=checkpointing,
        )
        return answer.classes[0].peak_bytes

    probabilities = NarrowAttention.HEADS * NarrowAttention.SEQ**2 * 4
    assert peak("cpu") - peak("cuda") >= probabilities


def test_deepseek_v3_671b_at_256_ranks_is_traced_at_three_depths() -> None:
    """The published model at the FSDP world the report checks: its 58 MoE layers after 3 dense
    ones are the alike run, traced at three depths and extrapolated exactly; MLA attention on a
    CUDA target, experts through transformers' grouped_mm under balanced routing."""
    from test_report import FSDP_UNITS, FSDP_WORLDS

    from meshbind.interop.hf_plans import from_hf_plan

    from hf_models import hf_model

    def build() -> nn.Module:
        model = hf_model("deepseek_v3", real=True)
        model.config._experts_implementation = "grouped_mm"
        return model

    with torch.device("meta"):
        plan_source = from_hf_plan(build())
    answer = traced(
        build,
        plan_source,
        LayoutContext(FSDP_WORLDS["deepseek_v3"]),
        batch=1,
        seq_len=4096,
        fully_shard=FSDP_UNITS,
        activation_checkpointing="full",
    )
    (only,) = answer.classes
    assert (only.first_rank, only.ranks) == (0, 256)
    assert only.traced == "3, 4 and 5 of the 58 alike blocks of model.layers, extrapolated (exact)"
    # Adam's two moments of each sharded parameter, and its 4-byte step count per parameter.
    moments = 2 * only.live_at_peak["parameters"]
    assert moments < only.live_at_peak["optimizer_state"] < moments + 4 * 10_000
    assert only.live_at_peak["activations"] > 0 and only.peak_bytes == sum(only.live_at_peak.values())


def test_the_page_draws_each_rank_class_step_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from selenium.webdriver.common.by import By

    from meshbind.cli import main

    page = tmp_path / "report.html"
    memory = ["--memory", "--batch", "1", "--seq-len", "32", "--device", "cpu", "--device-memory", "1MiB"]
    assert main([*DEMO_CHECK, *memory, "--json", "--html", str(page)]) == 1
    answer = json.loads(capsys.readouterr().out)["memory"]
    with opened_page(page) as driver:
        bars = driver.find_elements(By.CSS_SELECTOR, "#memory .bar")
        drawn = [tuple(int(bar.get_attribute(f"data-{key}")) for key in ("first", "count", "peak")) for bar in bars]
        assert drawn == [(0, 8, answer["peak_bytes"])]
        kinds = {piece.get_attribute("data-kind") for piece in bars[0].find_elements(By.CSS_SELECTOR, ".kind")}
        assert kinds == {kind for kind, size in answer["rank_classes"][0]["live_at_peak"].items() if size}
        assert "does NOT fit" in driver.find_element(By.ID, "memory-step").text


class WideMLP(nn.Module):
    """Blocks of an up and a down projection, as a torch plan shards them (colwise, rowwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 64)
        self.layers = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(64, 1024), "down": nn.Linear(1024, 64)}) for _ in range(2))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer["down"](torch.relu(layer["up"](x)))  # type: ignore[index]
        return x.float().pow(2).mean()


def test_a_torch_plan_is_applied_by_torch_and_tp_halves_the_projections_state() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from meshbind import from_torch_plan

    plan = from_torch_plan({"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()})

    def peak(tp: int) -> dict[str, int]:
        answer = traced(WideMLP, plan, LayoutContext({"tp": tp}), batch=1, seq_len=8, device="cpu")
        return dict(answer.classes[0].live_at_peak)

    whole, halved = peak(1), peak(2)
    # tp=2 holds half of each layer's up weight, up bias and down weight (float32), and Adam's
    # two moments of them (and less of the step's temporaries, counted with the state); the down
    # bias stays whole.
    sharded = 2 * 4 * (64 * 1024 + 1024 + 1024 * 64)
    assert whole["parameters"] - halved["parameters"] == sharded // 2
    assert whole["optimizer_state"] - halved["optimizer_state"] >= sharded


class AttentionCalls(TorchFunctionMode):
    """Every ``scaled_dot_product_attention`` call: its query, key and value shapes, its mask's
    shape (``None``: no mask), ``is_causal`` and ``enable_gqa``, which decide the kernel torch runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append(
                (
                    *(tuple(tensor.shape) for tensor in args[:3]),
                    None if mask is None else tuple(mask.shape),
                    kwargs.get("is_causal", False),
                    kwargs.get("enable_gqa", False),
                )
            )
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "gemma3_text"])
def test_the_trace_calls_sdpa_as_a_real_step_does(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers takes a fake tensor for tracing and would build a [B, 1, S, S] mask (and repeat
    the key/value heads) where a real step passes none; the trace takes the real step's path.
    Gemma 3's sliding layers keep their mask in both."""
    from meshbind import forks
    from meshbind.memory.step import default_inputs, training_step

    monkeypatch.setattr(forks, "usable_cores", lambda: 1)  # the calls are watched in this process

    def sdpa_model() -> nn.Module:
        model = hf_transformer(name)
        model.config._attn_implementation = "sdpa"
        return model.train()

    real = sdpa_model()
    args, kwargs = default_inputs(real)(2, 16)
    with AttentionCalls() as real_calls:
        training_step(real, None, args, kwargs)
    with AttentionCalls() as traced_calls:
        traced(sdpa_model, [], LayoutContext({}), batch=2, seq_len=16, optimizer="none", device="cpu", alike_layers=False)
    assert real_calls.calls and traced_calls.calls == real_calls.calls, (real_calls.calls, traced_calls.calls)
    if name != "gemma3_text":
        assert all(call[3] is None and call[4] for call in real_calls.calls)


class TinyLM(nn.Module):
    """Embedding and head; with ``meta_bytes``, a forward that also makes and keeps a meta tensor
    of that size, as transformers' TP code makes meta tensors to read strides."""

    def __init__(self, meta_bytes: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64)
        self.meta_bytes = meta_bytes

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.meta_bytes:
            self.strides_probe = torch.empty(self.meta_bytes, dtype=torch.uint8, device="meta")
        logits = self.head(self.embed(ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_meta_tensors_hold_no_memory_in_the_estimate() -> None:
    def peak(meta_bytes: int) -> StepMemory:
        return traced(lambda: TinyLM(meta_bytes), [], LayoutContext({}), batch=2, seq_len=8, device="cpu")

    without, with_meta = peak(0), peak(2**30)
    assert with_meta.peak_bytes == without.peak_bytes
    assert with_meta.classes[0].live_at_peak == without.classes[0].live_at_peak


def test_the_truth_counts_a_free_on_another_thread_and_returns_to_its_start_after_a_step() -> None:
    """The measured truth reads the allocator's process-wide total: a free gloo makes on a worker
    thread lowers it as one on the profiling thread does, and one real step ends where it began."""
    import threading

    from meshbind.memory.step import make_optimizer, make_optimizer_state, training_step

    from step_memory_truth import _step_totals, count_every_thread

    count_every_thread()
    held = [torch.empty(2**20)]  # 4 MiB, freed by another thread during the step

    def step() -> None:
        first = torch.empty(1024)
        elsewhere = threading.Thread(target=held.clear)
        elsewhere.start()
        elsewhere.join()
        second = torch.empty(1024)
        del first, second

    totals = _step_totals(step)
    assert totals[1] - totals[0] == 4096 and totals[2] - totals[0] == 2 * 4096 - 2**22
    assert totals[-1] - totals[0] == -(2**22)

    model = TinyLM()
    optimizer = make_optimizer(model, "adam", "cpu")
    make_optimizer_state(optimizer)
    ids = torch.zeros(2, 8, dtype=torch.long)
    totals = _step_totals(lambda: training_step(model, optimizer, (ids, ids.clone()), {}))
    assert len(totals) > 10 and totals[-1] == totals[0] and max(totals) > totals[0]


FIRST_AND_LATER_TRACE = """
import torch
from step_memory_checks import hf_transformer, traced
from meshbind import FullyShard, LayoutContext
from meshbind.interop.hf_plans import from_hf_plan

def peak():
    with torch.device("meta"):
        source = from_hf_plan(hf_transformer("llama"))
    answer = traced(lambda: hf_transformer("llama"), source, LayoutContext({"dp_shard": 2, "tp": 2}), batch=2, seq_len=64,
                    fully_shard=FullyShard(("model.layers.*",)), activation_checkpointing="selective-layer:2", device="cpu")
    return answer.classes[0].peak_bytes

print(peak(), peak())
"""


def test_the_first_trace_in_a_process_counts_what_a_later_one_does() -> None:
    """DTensor runs each op it has not met yet once on fake global tensors, to learn its output's
    shape: no memory of the step, and only in a process's first step. The trace does not count it
    (it once put a 64 KiB temporary at the peak of the first trace only)."""
    import subprocess
    import sys

    tests = str(Path(__file__).resolve().parent)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", FIRST_AND_LATER_TRACE], capture_output=True, text=True, timeout=300, env=environment, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first, later = map(int, result.stdout.split()[-2:])
    assert first == later


def test_the_truth_is_not_raised_by_a_buffer_another_thread_frees_late() -> None:
    """A worker thread that holds a step's buffer past the step's own last use (as a gloo worker
    scheduled late does) raises that one step's peak; the truth is the lowest of identical steps."""
    import threading

    from step_memory_truth import count_every_thread, lowest_step_added

    count_every_thread()
    steps: list[int] = []

    def step() -> None:
        handed = [torch.empty(2**20)]  # 4 MiB whose last reference a worker holds
        release = threading.Event()
        worker = threading.Thread(target=lambda: (release.wait(), handed.clear()))
        worker.start()
        if steps:  # every step but the first: the worker lets go before the next buffer
            release.set()
            worker.join()
        steps.append(1)
        following = torch.empty(2**20)
        del following
        release.set()
        worker.join()

    assert lowest_step_added(step) == 2**22
    assert len(steps) == 3  # the first two disagree: a third decides


def test_the_truth_stops_at_two_steps_that_agree() -> None:
    from step_memory_truth import count_every_thread, lowest_step_added

    count_every_thread()
    sizes = iter([2**20, 2**20, 2**18])  # a third step would read lower

    def step() -> None:
        held = torch.empty(next(sizes))
        del held

    assert lowest_step_added(step) == 2**22


def test_in_a_world_every_rank_takes_a_third_step_when_one_rank_needs_it() -> None:
    """A step's collectives need every rank: a rank whose first two steps differ does not run its
    third alone (it would wait on the others for ever), the others run theirs with it."""
    assert run_local_world(2, "step_memory_checks:uneven_first_steps", 1, timeout=60) == [3, 3]


def test_a_world_of_a_million_ranks_is_traced_from_the_ranks_own_groups_and_chunks() -> None:
    """Only the traced rank's groups and the parameter chunks it reads are made: a million ranks
    trace in seconds, with FSDP's padding as torch makes it (every rank's chunk as long as the first)."""
    small = traced(lambda: TinyLM(), [], LayoutContext({"dp_shard": 2}), batch=1, seq_len=8, device="cpu")
    large = traced(lambda: TinyLM(), [], LayoutContext({"dp_shard": 10**6}), batch=1, seq_len=8, device="cpu")
    assert large.classes[0].ranks == 10**6
    parameter_elements = sum(p.numel() for p in TinyLM().parameters())
    parameter_tensors = len(list(TinyLM().parameters()))
    # each parameter is shorter than the world: one row per rank, padded, gathered at 10**6 rows
    assert large.classes[0].live_at_peak["parameters"] < small.classes[0].live_at_peak["parameters"]
    assert large.classes[0].live_at_peak["all_gather"] >= 10**6 * parameter_tensors * 4 > parameter_elements * 4


@pytest.mark.parametrize("shape", [(0, 3), (1,), (5, 2), (7,), (16, 4), (3, 9)])
def test_the_traced_ranks_chunks_are_torchs_own(shape: tuple[int, ...]) -> None:
    """RankChunks gives, chunk by chunk, what FSDP2's _chunk_with_empty gives; the trace puts
    torch's function back after it."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from meshbind.memory.fsdp_chunks import RankChunks, chunks_for_traced_rank

    tensor = torch.randn(shape)
    for dim in range(len(shape)):
        for count in (1, 2, 3, 5, 8, 17):
            expected, made = _chunk_with_empty(tensor, count, dim), RankChunks(tensor, count, dim)
            assert len(made) == len(expected)
            for index in range(-count, count):
                assert made[index].shape == expected[index].shape and torch.equal(made[index], expected[index])
    with chunks_for_traced_rank():
        assert _fsdp_param._chunk_with_empty is RankChunks
    assert _fsdp_param._chunk_with_empty is _chunk_with_empty


def test_a_cuda_target_traces_flash_attention_where_cuda_runs_it() -> None:
    """Half precision without a mask: flash attention, grouped key/value heads read in place;
    float32: the memory-efficient kernel, the heads repeated first, as CUDA runs it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshbind.memory.attention import CudaAttention

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def operators(dtype: torch.dtype) -> list[str]:
        with FakeTensorMode(), CudaAttention():
            query = torch.empty(1, 16, 64, 32, dtype=dtype)
            key, value = torch.empty(1, 4, 64, 32, dtype=dtype), torch.empty(1, 4, 64, 32, dtype=dtype)
            with Ops() as ops:
                nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
        return ops.names

    half = operators(torch.bfloat16)  # repeat_interleave runs as expand, then clone (the copy)
    assert "_scaled_dot_product_flash_attention.default" in half and "clone.default" not in half
    float32 = operators(torch.float32)
    assert "_scaled_dot_product_efficient_attention.default" in float32 and "clone.default" in float32


def test_mixed_precision_is_traced_at_the_dtypes_torch_uses() -> None:
    """Under bf16/fp32 mixed precision the sharded float32 parameters and Adam's state stay as they
    are, while the gathered copies, the all-gather buffers and the activations are bfloat16 (half)."""
    axes = {"dp_shard": 2, "cp": 1, "tp": 2, "ep": 2}

    def live(param_dtype: str | None) -> dict[str, int]:
        build = lambda: MoETransformer(TransformerConfig(layers=LAYERS, experts=EXPERTS))  # noqa: E731
        fully_shard = demo_units(2, param_dtype)
        answer = traced(
            build, [loss_head_request()], LayoutContext(axes), fully_shard=fully_shard, batch=2, seq_len=SEQ_LEN, device="cpu"
        )
        return dict(answer.classes[0].live_at_peak)

    full, mixed = live(None), live("bfloat16")
    assert mixed["parameters"] == full["parameters"] and mixed["optimizer_state"] == full["optimizer_state"]
    assert 2 * mixed["unsharded_parameters"] == full["unsharded_parameters"] and 2 * mixed["all_gather"] == full["all_gather"]
    assert 0.45 * full["activations"] < mixed["activations"] < 0.55 * full["activations"]


def test_a_graph_a_split_backward_kept_is_freed_once_let_go_of_and_the_backward_ends_each_module() -> None:
    """torch's module tracker waits for a module's input gradients with hooks that hold the inputs'
    autograd nodes in a reference cycle: a graph a backward kept (a split backward's input half,
    reached from a released output's gradient edge, as a pipeline stage runs it) would hold its
    saved activations after the stage lets go of it, until a garbage collection. The trackers' own
    hooks let go of the nodes once run, and the backward still ends every module's backward."""
    import gc

    from meshbind.memory.trackers import TRACED_DEVICE, step_tracker, traced_step

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    given = torch.randn(16, 64, requires_grad=True)
    tracker = step_tracker([model], None, (given,))
    ended: list[str] = []
    backward_ended = tracker._post_bw_hook

    def ending(module: nn.Module, grads: Any) -> None:
        ended.append(type(module).__name__)
        backward_ended(module, grads)

    tracker._post_bw_hook = ending  # type: ignore[method-assign]

    def live() -> int:
        return int(tracker.get_tracker_snapshot()[TRACED_DEVICE]["Total"])

    gc.disable()  # a collection would free the cycle and hide it
    try:
        with traced_step(tracker):
            before = live()
            output = model(given * 2)  # a non-leaf input: its node is waited on
            edge, gradient = torch.autograd.graph.get_gradient_edge(output), torch.ones_like(output)
            del output
            torch.autograd.grad([edge], [given], [gradient], retain_graph=True)
            assert live() > before
            del edge, gradient
            assert live() == before
    finally:
        gc.enable()
    assert sorted(ended) == ["Linear", "Linear", "Sequential", "Tanh"]


def _without_seconds(answer: Any) -> Any:
    if isinstance(answer, dict):
        return {key: _without_seconds(value) for key, value in answer.items() if key != "seconds"}
    if isinstance(answer, list):
        return [_without_seconds(value) for value in answer]
    return answer


class WideBlocks(nn.Module):
    """Wide layers over two tokens: the parameters outweigh the activations, so a step's peak falls
    in the optimizer's step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 512)
        self.blocks = nn.ModuleList([nn.Linear(512, 512) for _ in range(16)])

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()


@pytest.mark.parametrize(
    ("build", "axes", "schedule", "optimizer"),
    [
        (WideBlocks, {"dp_shard": 2}, None, "adam"),
        (WideBlocks, {"dp_shard": 2}, None, "sgd-momentum"),
        (lambda: MoETransformer(TransformerConfig(layers=4, experts=4)), {"pp": 2, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 1},
         "Interleaved1F1B", "adam"),
    ],
)  # fmt: skip
def test_a_trace_steps_the_local_shards_and_counts_what_torchs_dtensor_step_counts(
    build: Any, axes: dict[str, int], schedule: str | None, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA trace's foreach optimizer steps the DTensor parameters' local shards; torch's own
    foreach step over the DTensors makes the same bytes and the same collectives, whether the peak
    falls in the optimizer's step (the wide blocks) or not (the pipeline)."""
    from meshbind import forks
    from meshbind.comms.with_memory import step_memory_and_comms
    from meshbind.memory import fake_step, pipelined, step
    from meshbind.pipeline import Pipeline

    monkeypatch.setattr(forks, "_in_a_child", True)  # traced here, where the optimizers made are seen
    with torch.device("meta"):
        model = build()
    requests = [loss_head_request()] if schedule else []
    units = FullyShard(("blocks.*.moe", "blocks.*") if schedule else ("blocks.*",))
    plan = resolve_plan(model, requests, LayoutContext(axes), fully_shard=units, index=True)
    original = step.make_optimizer

    def answer(on_local_shards: bool) -> tuple[Any, list[str]]:
        made: list[str] = []

        def make(model: nn.Module, name: Any, device: Any, **asked: Any) -> Any:  # what the trace asks, overruled
            optimizer = original(model, name, device, on_local_shards=on_local_shards)
            made.append(type(optimizer).__name__)
            return optimizer

        monkeypatch.setattr(fake_step, "make_optimizer", make)
        monkeypatch.setattr(pipelined, "make_optimizer", make)
        memory, comms = step_memory_and_comms(
            build, plan, batch=4 if schedule else 1, seq_len=16 if schedule else 2, optimizer=optimizer, device="cuda",
            pipeline=Pipeline(schedule, microbatches=4) if schedule else None, alike_layers=False,
        )  # fmt: skip
        return _without_seconds({"memory": memory.to_dict(), "comms": comms.to_dict()}), made

    on_shards, made_on_shards = answer(True)
    on_dtensors, made_on_dtensors = answer(False)
    assert made_on_shards and all(name.endswith("OnLocalShards") for name in made_on_shards)
    assert made_on_dtensors and not any(name.endswith("OnLocalShards") for name in made_on_dtensors)
    if optimizer == "adam" and not schedule:  # the case that tells the optimizers' steps apart
        assert [c["peak_phase"] for c in on_shards["memory"]["rank_classes"]] == ["optimizer step"]
    assert on_shards == on_dtensors
