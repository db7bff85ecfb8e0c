"""The benchmark machinery (not its timings): `meshbind bench` and benches/ run, agree across
methods, plot and rewrite the docs' table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import apply_layouts as apply_layouts_bench
import binding as binding_bench
import fsdp_apply as fsdp_apply_bench
import plan_resolution
import pytest
import resolution_methods
import validation_floor

from meshbind import bench
from meshbind.cli import main
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig
from meshbind.examples.moe_tree import build_moe_tree, moe_tree_fqns


def test_the_resolution_benchmark_runs_every_method_side_by_side_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot, rows = tmp_path / "plot.png", tmp_path / "rows.json"
    argv = ["--sizes", "8x8", "--plans", "deep,typo,globstar", "--plot", str(plot), "--json", str(rows)]
    assert plan_resolution.main(argv) == 0
    out = capsys.readouterr().out
    assert f"plot: {plot}" in out and plot.stat().st_size > 1000
    data = json.loads(rows.read_text())["rows"]
    typo = {row["method"]: row["noticed"] for row in data if row["plan"] == "typo" and row["tree"] == "8x8"}
    assert typo["meshbind"] and typo["meshbind_validate"] and typo["torch_parallelize_module"]
    assert not typo["fnmatch"] and not typo["one_regex"]
    globstar = {row["method"]: row["median_s"] for row in data if row["plan"] == "globstar"}
    assert globstar["fnmatch"] is None and globstar["torch_parallelize_module"] is None  # n/a: no ** or ranges
    assert "fastest Python baseline / meshbind" in out


SMALL_TREE = ["meshbind.examples.moe_tree:small_moe_tree", "meshbind.examples.moe_tree:deep_plan_requests"]


def test_meshbind_bench_times_each_phase_of_a_users_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *SMALL_TREE, "--axis", "tp=2", "--repeat", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["modules"], result["planned"], result["runs"]) == (len(moe_tree_fqns(4, 8)), 118, 3)
    phases = [result[f"{phase}_s"] for phase in bench.PHASES]
    assert all(seconds > 0 for seconds in phases) and result["total_s"] > 0
    assert main(["bench", *SMALL_TREE, "--axis", "tp=2", "--repeat", "3"]) == 0
    text = capsys.readouterr().out
    assert "MoeForCausalLM: 193 modules, 118 planned; the median of 3 runs" in text
    assert all(f"  {phase} " in text for phase in (*bench.PHASES, "total"))


def test_meshbind_bench_times_a_hugging_face_config_with_its_own_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hf_models import REAL

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", **REAL["qwen3_moe"]}))
    axes = ["--axis", "dp_shard=2", "--axis", "tp=4", "--axis", "ep=8"]
    assert main(["bench", "--hf-config", str(config), *axes, "--repeat", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "Qwen3MoeForCausalLM" and result["planned"] >= 48 * 5  # attention and experts, each layer
    assert result["modules"] > result["planned"] and result["runs"] == 1


def test_meshbind_bench_of_a_plan_with_problems_lists_them_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *SMALL_TREE]) == 1  # no 'tp' axis for the replicated weights
    assert "'tp'" in capsys.readouterr().err


def test_the_package_names_no_benchmark_method() -> None:
    """The baselines and floors live in benches/: nothing an installed wheel ships names them."""
    package = Path(bench.__file__).parent
    names = [name for name in plan_resolution.METHODS if "_" in name]  # not the words "meshbind", "fnmatch"
    assert len(names) >= 5
    sources = {path.name: path.read_text() for path in package.rglob("*.py")}
    assert not [(file, name) for file, text in sources.items() for name in names if name in text]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sizes", "0x4"], "size '0x4' is neither LAYERSxEXPERTS"),
        (["--json", "{file}/rows.json"], "--json .*rows.json: cannot make its folder"),
        (["--plot", "{file}/plot.png"], "--plot .*plot.png: cannot make its folder"),
        (["--docs", "{file}"], "--docs .* has no <!-- bench:start --> ... <!-- bench:end --> section"),
        (["--docs", "{file}/benchmarks.md"], "--docs .*benchmarks.md: Not a directory"),
    ],
)
def test_bad_sizes_and_outputs_are_refused_before_the_run(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "a_file"
    file.write_text("no markers")
    with pytest.raises(SystemExit) as exited:
        plan_resolution.main(["--plans", "deep", *(flag.format(file=file) for flag in flags)])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert re.search(message, captured.err) and "machine:" not in captured.out


def test_flat_names_are_matched_offline() -> None:
    methods = {name: resolution_methods.METHODS[name] for name in ("one_regex", "meshbind", "meshbind_validate")}
    rows = resolution_methods.run([resolution_methods.Size("flat", 2, 4, True)], ["deep", "per_layer"], 5, methods)
    assert {row.matches for row in rows} == {2 * (4 * 3 + 4 + 1) + 2}


def test_the_docs_section_is_rewritten_between_its_markers(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# title\n{plan_resolution.DOCS_START}\nold\n{plan_resolution.DOCS_END}\ntail\n")
    methods = {name: plan_resolution.METHODS[name] for name in ("one_regex", "meshbind", "rust_walk_floor", "hand_pruned_walk")}
    rows = resolution_methods.run([resolution_methods.Size.parse("4x4")], ["deep"], 5, methods)
    plan_resolution.update_docs(str(docs), rows, "python benches/plan_resolution.py --sizes 4x4", None)
    text = docs.read_text()
    assert "old" not in text and text.endswith("tail\n") and "| 4x4 |" in text and "Machine:" in text
    assert "meshbind / hand_pruned_walk = " in text


@pytest.mark.parametrize("plan", ["deep", "per_layer", "typo", "moe"])
def test_the_hand_pruned_walk_selects_what_meshbind_selects(plan: str) -> None:
    """The floor of a pruned walk shares no code with the matcher, and counts the same modules."""
    tree = build_moe_tree(4, 8)
    patterns = resolution_methods.PLANS[plan](4)
    walked = plan_resolution.hand_pruned_walk(tree, patterns)
    assert walked.matches == resolution_methods.meshbind_resolution(tree, patterns).matches > 0


@pytest.mark.parametrize("plan, fused", [("moe", True), ("deep", False), ("typo", False)])
def test_the_validation_floors_plan_what_meshbind_validate_plans(plan: str, fused: bool) -> None:
    tree = build_moe_tree(4, 8, fused_experts=fused)
    patterns = resolution_methods.PLANS[plan](4)
    floor, validated = validation_floor.validation_floor(tree, patterns), resolution_methods.meshbind_validate(tree, patterns)
    required = validation_floor.required_calls_floor(tree, patterns, resolution_methods.validation_requests(tree, patterns))
    assert floor.noticed == validated.noticed == required.noticed == (plan == "typo")
    assert floor.matches == required.matches == resolution_methods.meshbind_resolution(tree, patterns).matches
    assert validated.matches == (None if plan == "typo" else floor.matches)


def test_a_fast_method_runs_on_for_the_time_budget_and_a_slow_one_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[None] = []

    def method() -> resolution_methods.Outcome:
        calls.append(None)
        return resolution_methods.Outcome(1, False)

    monkeypatch.setattr(resolution_methods, "MIN_TIMED_SECONDS", 0.0)
    assert resolution_methods.time_method(method, 5)[1] == 5
    monkeypatch.setattr(resolution_methods, "MIN_TIMED_SECONDS", 60.0)
    monkeypatch.setattr(resolution_methods, "MAX_RUNS", 12)
    assert resolution_methods.time_method(method, 5)[1] == 12
    monkeypatch.setattr(resolution_methods, "SLOW_SECONDS", 0.0)
    assert resolution_methods.time_method(method, 5)[1] == 1
    assert len(calls) == 5 + 12 + 1


def test_the_binding_benchmark_binds_the_same_modules_by_every_method_and_creates_no_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tmp_path / "binding.json"
    assert binding_bench.main(["--layers", "2", "--repeat", "1", "--json", str(rows)]) == 0
    data = json.loads(rows.read_text())["rows"]
    assert [row["method"] for row in data] == list(binding_bench.METHODS)
    assert {(row["bound"], row["new_groups"]) for row in data} == {(5, 0)}
    captured = capsys.readouterr()
    assert "| 2 | 5 | meshbind |" in captured.out and "| 2 | 5 | torch_parallelize_module |" in captured.out
    assert "binding 2 layers on 2 ranks ..." in captured.err  # progress


@pytest.mark.parametrize("flags", [["--layers", "0"], ["--layers", "two"], ["--repeat", "0"], ["--world-size", "1"]])
def test_the_binding_benchmark_refuses_bad_flags(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        binding_bench.main(flags)
    assert exited.value.code == 2 and "--" in capsys.readouterr().err


def test_the_binding_benchmark_fails_when_a_method_binds_other_modules_or_creates_a_group() -> None:
    good = dict.fromkeys(binding_bench.METHODS, (0.001, 5, 0))
    slow = {**good, "by_hand": (0.003, 5, 0)}
    assert [row["median_s"] for row in binding_bench.rows_of(2, [good, slow])] == [0.001, 0.001, 0.003, 0.001]
    for wrong in ((0.001, 4, 0), (0.001, 5, 1)):
        with pytest.raises(AssertionError, match="by_hand at 2 layers"):
            binding_bench.rows_of(2, [good, {**good, "by_hand": wrong}])


def test_the_layouts_benchmark_places_the_same_parameters_by_both_methods(capsys: pytest.CaptureFixture[str]) -> None:
    assert apply_layouts_bench.main(["--layers", "2", "--experts", "4", "--world-size", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    # Per layer: qkv and out on tp, three fused expert weights and the router on ep.
    assert "| 2 | 4 | 12 | meshbind |" in out and "| 2 | 4 | 12 | torch |" in out
    assert "| 2 | 4 | 12 | meshbind_unchecked |" in out
    # Under FSDP every parameter is a DTensor: the embedding, the norms and the head as well.
    parameters = len(list(MoETransformer(TransformerConfig(layers=2, experts=4)).parameters()))
    assert f"| 2 | 4 | {parameters} | meshbind_fsdp |" in out and f"| 2 | 4 | {parameters} | torch_fsdp |" in out


def test_the_layouts_benchmark_fails_when_torch_places_other_parameters() -> None:
    placed = [("blocks.0.attn.qkv.weight", ("S(0)",), (6, 4))]
    good = {
        "meshbind": (0.1, placed),
        "meshbind_unchecked": (0.08, placed),
        "torch": (0.2, placed),
        "meshbind_fsdp": (0.5, placed),
        "torch_fsdp": (0.4, placed),
    }
    ratios = [row["x_meshbind"] for row in apply_layouts_bench.rows_of([good, good], 1, 4)]
    assert ratios == pytest.approx([1.0, 0.8, 2.0, 1.0, 0.8])
    with pytest.raises(AssertionError, match="torch on rank 1 placed other parameters"):
        apply_layouts_bench.rows_of([good, {**good, "torch": (0.2, [])}], 1, 4)


def test_the_fsdp_benchmark_places_the_same_parameters_by_both_paths(capsys: pytest.CaptureFixture[str]) -> None:
    # Four blocks of DeepSeek-V3 671B: three dense, one MoE (its router and shared experts planned).
    assert fsdp_apply_bench.main(["--layers", "4", "--world-size", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| DeepSeek-V3 671B (torchtitan) | 4 |")]
    assert [row.split(" | ")[3] for row in rows] == ["meshbind", "torch"]
    assert rows[0].split(" | ")[2] == rows[1].split(" | ")[2] != "0"
    placed = [("layers.0.attention.wq_b.weight", ("S(0)",), (6, 4))]
    with pytest.raises(AssertionError, match="torch on rank 1 placed other parameters"):
        good, bad = {"meshbind": (0.1, placed), "torch": (0.1, placed)}, {"meshbind": (0.1, placed), "torch": (0.1, [])}
        fsdp_apply_bench.rows_of([good, bad], 4)
