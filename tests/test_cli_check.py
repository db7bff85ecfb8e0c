"""SPEC §7 ``meshbind check``: offline pre-flight of a plan against a model built on meta."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from meshbind.cli import main

MODEL = "meshbind.examples.moe_tree:small_moe_tree"
PLAN = "meshbind.examples.moe_tree:deep_plan_requests"


def test_a_valid_plan_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", MODEL, PLAN, "--axis", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert "layers.3.mlp.experts.7.down_proj" in out and "118 planned modules; layout tp=2" in out


def test_every_problem_is_printed_with_a_failing_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", MODEL, PLAN, "--axis", "dp_shard=2", "--axis", "ep=2"]) == 1
    err = capsys.readouterr().err
    assert "the plan has 118 problems" in err and "which the layout context lacks (axes: dp_shard, ep)" in err


def test_json_output_is_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", MODEL, PLAN, "--axis", "dp_shard=2", "--axis", "ep=2", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and len(report["problems"]) == 118
    assert report["problems"][0]["code"] == "layout"
    assert main(["check", MODEL, PLAN, "--axis", "tp=1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and len(report["plan"]["modules"]) == 118
    assert report["report"]["totals"]["parameters"] > 0 and report["report"]["rank_groups"]  # without --report too


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "meshbind.examples.moe_tree", PLAN], "must be written module:attribute"),
        (["check", "meshbind.nowhere:f", PLAN], "importing 'meshbind.nowhere' raised ModuleNotFoundError"),
        (["check", "meshbind.examples.moe_tree:nothing", PLAN], "has no attribute 'nothing'"),
        (["check", "meshbind.examples.moe_tree:DEEP_PLAN", PLAN], "is not callable"),
        (
            ["check", MODEL, "meshbind.examples.moe_tree:DEEP_PLAN"],
            "must be, or return, a sequence of NativeParallelBindingRequest",
        ),
        (["check", MODEL, "math:pi"], "must be, or return, a sequence of NativeParallelBindingRequest"),
        (["check", MODEL, PLAN, "--axis", "ep=2", "--axis", "tp=1", "--axis", "ep=4"], "--axis ep is given more than once"),
        (
            ["check", MODEL, PLAN, "--axis", "tp=2", "--axis", "ep=4", "--report"],
            r"ep=4 does not divide dp_shard \* cp \* tp = 1 \* 1 \* 2 = 2.*use ep = 1, 2,",
        ),
    ],
)
def test_bad_references_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshbind check: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err)


def _raise(error: Exception) -> None:
    raise error


@pytest.fixture
def user_code(monkeypatch: pytest.MonkeyPatch) -> str:
    """A module ``user_code`` of factories and plans that fail."""
    module = types.ModuleType("user_code")
    module.runtime_error = lambda: _raise(RuntimeError("boom"))  # type: ignore[attr-defined]
    module.value_error = lambda: _raise(ValueError("bad config"))  # type: ignore[attr-defined]
    module.not_a_module = lambda: 5  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_code", module)
    return module.__name__


@pytest.mark.parametrize(
    ("factory", "plan", "message"),
    [
        (
            "user_code:runtime_error",
            PLAN,
            r"MODEL_FACTORY user_code:runtime_error raised RuntimeError: boom \(.*test_cli_check.py:\d+\)",
        ),
        ("user_code:value_error", PLAN, "MODEL_FACTORY user_code:value_error raised ValueError: bad config"),
        ("user_code:not_a_module", PLAN, "MODEL_FACTORY user_code:not_a_module returned int, not an nn.Module"),
        (MODEL, "user_code:runtime_error", "PLAN user_code:runtime_error raised RuntimeError: boom"),
    ],
)
def test_what_the_users_code_raises_is_a_one_line_error_naming_it(
    user_code: str, factory: str, plan: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", factory, plan]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("meshbind check: ") and re.search(message, last)


def test_a_module_that_fails_on_import_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken_plans.py").write_text('raise RuntimeError("import boom")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", MODEL, "broken_plans:PLAN"]) == 2
    err = capsys.readouterr().err
    expected = r"^meshbind check: PLAN broken_plans:PLAN: importing 'broken_plans' raised RuntimeError: import boom"
    assert re.search(expected + r" \(.*broken_plans.py:1\)$", err.strip())


def test_the_meshbind_script_finds_the_users_modules_in_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "my_model.py").write_text("from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(2, 2))\n")
    (tmp_path / "my_plan.py").write_text(
        "from meshbind import ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec\n"
        "spec = ParallelModuleSpec('linear', stages={'forward': ('input',)})\n"
        "REQUESTS = [NativeParallelBindingRequest(('0',), spec, lambda module, fqn, context: ModuleShardingSpec())]\n"
    )
    script = Path(sys.executable).with_name("meshbind")
    result = subprocess.run(
        [str(script), "check", "my_model:build", "my_plan:REQUESTS"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "1 planned module; layout (no axes)" in result.stdout


def test_the_command_line_defines_no_family_class_before_the_demo_runs() -> None:
    """The demo model's family classes would make every `meshbind check` and `meshbind bench`
    resolution walk the whole tree (a fresh interpreter: the tests here define family classes)."""
    script = "import meshbind.cli; from meshbind.family import family_classes_declared; print(family_classes_declared())"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["check", "--help"],
        ["bench", "--help"],
        ["demo", "--help"],
        ["check", "--optimizer", "sgd"],
        ["demo", "--dtype", "x"],
    ],
)
def test_help_and_argument_errors_answer_at_once_without_torch(argv: list[str]) -> None:
    """Neither torch nor transformers is imported before a command runs: the answer comes in well
    under a second, interpreter start included."""
    script = (
        "import sys\nfrom meshbind.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60, check=False)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[]"
    assert "usage: meshbind" in result.stdout + result.stderr
    assert elapsed < 1.0, f"{argv}: {elapsed:.2f} s"


def test_ctrl_c_while_torch_is_imported_ends_in_one_line() -> None:
    """SIGINT once torch's own modules are being imported (``-X importtime`` tells when): exit 130,
    no traceback."""
    command = [sys.executable, "-X", "importtime", "-m", "meshbind", "check", MODEL, PLAN]
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal, not a background job
    )
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        seen.append(line)
        if " torch." in line:  # a module of torch has been imported: torch itself is still importing
            break
    process.send_signal(signal.SIGINT)
    rest = process.stderr.read()
    assert process.wait(timeout=60) == 130
    err = [line for line in "".join([*seen, rest]).splitlines() if not line.startswith("import time:")]
    assert err == ["meshbind check: interrupted"], err


def test_a_malformed_axis_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["check", MODEL, PLAN, "--axis", "tp=x"])
    assert exited.value.code == 2
    assert "an axis is NAME=SIZE" in capsys.readouterr().err


def test_the_demo_model_is_checked_offline(capsys: pytest.CaptureFixture[str]) -> None:
    model = "meshbind.examples.moe_transformer:MoETransformer"
    plan = "meshbind.examples.moe_transformer:loss_head_request"
    assert main(["check", model, plan, "--axis", "dp=1", "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=2"]) == 0
    assert "5 planned modules" in capsys.readouterr().out
    assert main(["check", model, plan, "--axis", "dp_shard=3", "--axis", "cp=2", "--axis", "ep=3"]) == 1
    assert "num_experts 8 is not divisible by the 'ep' axis size 3" in capsys.readouterr().err


@pytest.fixture
def torch_plans(monkeypatch: pytest.MonkeyPatch) -> str:
    """A module ``torch_plans`` of parallelize_module dicts for the small MoE tree."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    module = types.ModuleType("torch_plans")
    module.good = {"layers.*.self_attn.q_proj": ColwiseParallel(), "layers.*.self_attn.o_proj": RowwiseParallel()}  # type: ignore[attr-defined]
    module.typo = {"layers.*.self_attn.qproj": ColwiseParallel()}  # type: ignore[attr-defined]
    module.not_a_plan = lambda: ["q_proj"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_plans", module)
    return module.__name__


def test_a_torch_plan_is_checked_against_the_axes(torch_plans: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", MODEL, "--torch-plan", f"{torch_plans}:good", "--axis", "tp=2"]) == 0
    assert "layers.3.self_attn.q_proj" in capsys.readouterr().out
    assert main(["check", MODEL, "--torch-plan", f"{torch_plans}:typo", "--axis", "tp=2"]) == 1
    assert "pattern 'layers.*.self_attn.qproj' does not select any module; did you mean" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", MODEL, "--torch-plan", "torch_plans:not_a_plan"], "--torch-plan torch_plans:not_a_plan: a torch plan maps"),
        (["check", MODEL, PLAN, "--torch-plan", "torch_plans:good"], "give a PLAN or --torch-plan, not both"),
        (["check", MODEL], "give a PLAN (module:attribute) or --torch-plan module:attribute"),
        (["check", "--axis", "tp=2"], "give a MODEL_FACTORY (module:function), or --hf-config CONFIG.json"),
    ],
)
def test_a_torch_plan_reference_that_cannot_work_is_a_usage_error(
    torch_plans: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def qwen3_moe_config(tmp_path: Path) -> Path:
    """Qwen3-30B-A3B's config file as a user has it (48 layers, 128 experts, 4 key/value heads)."""
    from hf_models import REAL

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_moe", **REAL["qwen3_moe"]}))
    return path


def test_a_hugging_face_config_is_checked_with_its_own_plans(qwen3_moe_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--hf-config", str(qwen3_moe_config), "--axis", "dp_shard=2", "--axis", "tp=4", "--axis", "ep=8"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.47.mlp.experts" in out and "gate_up_proj=ep:S(0)" in out
    assert "warning: unmatched (key): key 'model.layers.*.mlp.gate_proj' (colwise)" in out
    assert main(["check", "--hf-config", str(qwen3_moe_config), "--axis", "dp_shard=3", "--axis", "tp=8", "--axis", "ep=3"]) == 1
    err = capsys.readouterr().err
    assert (
        "48 modules 'model.layers.<0-47>.self_attn.k_proj': num_key_value_heads 4 is not divisible by the 'tp' axis size 8" in err
    )
    assert "48 modules 'model.layers.<0-47>.mlp.experts': num_local_experts 128 is not divisible by the 'ep' axis size 3" in err
    assert main(["check", "--hf-config", str(qwen3_moe_config), "--axis", "tp=4", "--strict"]) == 1
    assert "unmatched (key): key 'model.layers.*.mlp.up_proj'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hf-config", "missing.json"], "--hf-config missing.json: [Errno 2]"),
        (["--hf-config", "CONFIG", MODEL], "--hf-config builds the model and reads its own plans"),
        (["--hf-config", "NOT_A_CONFIG"], "a transformers config.json is an object with a 'model_type'"),
        ([MODEL, PLAN, "--strict"], "--strict is for --hf-config"),
    ],
)
def test_a_hugging_face_config_that_cannot_work_is_a_usage_error(
    argv: list[str], message: str, qwen3_moe_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "list.json").write_text("[1, 2]")
    argv = [str(qwen3_moe_config) if a == "CONFIG" else str(tmp_path / "list.json") if a == "NOT_A_CONFIG" else a for a in argv]
    assert main(["check", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("where", "because"),
    [("missing/page.html", "does not exist"), (".", "is a directory, not a file to write")],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(
    tmp_path: Path, where: str, because: str, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / where
    assert main(["check", MODEL, PLAN, "--axis", "tp=2", "--html", str(page)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"meshbind check: --html {page}: ") and because in err
    assert "building" not in err and len(err.strip().splitlines()) == 1  # refused before the model was built


def test_a_config_field_left_to_its_default_is_said_to_be(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hf_models import REAL

    values = {key: value for key, value in REAL["qwen3_moe"].items() if key != "num_attention_heads"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen3_moe", **values}))
    main(["check", "--hf-config", str(path), "--axis", "tp=2"])
    err = capsys.readouterr().err
    assert f"--hf-config {path}: the file sets no num_attention_heads: checked against 32, Qwen3MoeConfig's default" in err
    assert "the file sets no num_key_value_heads" not in err and "the file sets no vocab_size" not in err


def test_slow_layout_providers_show_progress_in_the_command_line_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import time

    from torch import nn

    from meshbind import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec, resolve_plan

    def slow(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        time.sleep(0.1)  # a provider that reads a file or asks a service
        return ModuleShardingSpec()

    module = types.ModuleType("slow_plans")
    module.model = lambda: nn.ModuleList(nn.Linear(2, 2) for _ in range(30))  # type: ignore[attr-defined]
    module.plan = [NativeParallelBindingRequest(("*",), ParallelModuleSpec("slow"), slow)]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "slow_plans", module)
    assert main(["check", "slow_plans:model", "slow_plans:plan", "--axis", "tp=1"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"\rlayout providers: \[#+\.*\] \d+/30 \d s", err), err
    assert "layout providers: [" + "#" * 30 + "] 30/30" in err
    resolve_plan(module.model(), module.plan, LayoutContext({"tp": 1}))
    assert capsys.readouterr().err == ""  # a library call is silent unless asked


def test_the_bar_says_how_long_the_rest_of_its_step_takes_at_its_pace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The time left is the step's own pace (not counting an earlier step) times what is left; a
    step stopped part way (a time limit, Ctrl-C) still ends its line, one that finished ends its own."""
    from meshbind.cli import progress

    clock = iter([0.0, 100.0, 130.0, 160.0, 460.0, 0.0, 3.0, 4.0, 5.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with progress.ProgressBar() as bar:
        bar("checking the rules", 10, 10)  # at 100 s: nothing drawn yet, so no closing line either
        bar("tracing layouts", 0, 40)  # the tracing starts at 130 s
        bar("tracing layouts", 1, 40)  # 30 s a layout: 39 left
        bar("tracing layouts", 2, 40)  # 165 s a layout: 38 left, and then stopped
    err = capsys.readouterr().err
    assert err.endswith("pace\n") and err.count("\n") == 1
    assert err.removesuffix("\n").split("\r")[1:] == [
        "tracing layouts: [" + "." * 30 + "] 0/40 130 s",
        "tracing layouts: [" + "." * 30 + "] 1/40 160 s, about 20 min left at this pace",
        "tracing layouts: [#" + "." * 29 + "] 2/40 460 s, about 1 h 44 min left at this pace",
    ]
    with progress.ProgressBar() as bar:
        bar("checking the rules", 1, 5)  # the first report, with one share done before it
        bar("checking the rules", 2, 5)  # one share a second since: three left
        bar("checking the rules", 5, 5)  # shorter than the line before: blanks its end
    lines = [
        f"checking the rules: [{'#' * 6}{'.' * 24}] 1/5 3 s",
        f"checking the rules: [{'#' * 12}{'.' * 18}] 2/5 4 s, about 3 s left at this pace",
    ]
    last = "checking the rules: [" + "#" * 30 + "] 5/5 5 s"
    assert capsys.readouterr().err == f"\r{lines[0]}\r{lines[1]}\r{last.ljust(len(lines[1]))}\n"
    assert [progress.duration_text(s) for s in (0.4, 119, 121, 3000, 7170)] == ["0 s", "119 s", "2 min", "50 min", "2 h 0 min"]


def test_fsdp_units_are_checked_and_counted_offline(capsys: pytest.CaptureFixture[str]) -> None:
    model = "meshbind.examples.moe_transformer:MoETransformer"
    plan = "meshbind.examples.moe_transformer:loss_head_request"
    axes = ["--axis", "dp_shard=2", "--axis", "cp=2", "--axis", "tp=2", "--axis", "ep=4"]
    units = ["--fully-shard", "blocks.*.moe", "--fully-shard", "blocks.*"]
    assert main(["check", model, plan, *axes, *units, "--report"]) == 0
    out = capsys.readouterr().out
    assert "2 x blocks.<0-1>.attn.qkv.weight  [96, 32] -> [12, 32]  tp:S(0), fsdp/4" in out
    assert main(["check", model, plan, *axes, "--fully-shard", "blocks.*"]) == 1
    assert "fsdp      2 modules 'blocks.<0-1>': holds parameters of the expert mesh" in capsys.readouterr().err
    assert main(["check", model, plan, "--axis", "sp=2"]) == 2
    assert "--axis: LayoutContext: 'sp' is not an axis of the world" in capsys.readouterr().err


@pytest.fixture
def small_llama_config(tmp_path: Path) -> Path:
    path = tmp_path / "llama.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 128,
                                "max_position_embeddings": 32}))  # fmt: skip
    return path


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (["--batch", "1", "--seq-len", "1000000000000"], "--seq-len 1000000000000 is over the limit of 2,147,483,647"),
        (["--batch", str(10**19), "--seq-len", "8"], f"--batch {10**19} is over the limit of 2,147,483,647 (2**31 - 1)"),
        (["--batch", "65536", "--seq-len", "65536"], "--batch 65536 x --seq-len 65536 is 4,294,967,296 tokens per rank"),
    ],
    ids=["seq-len 1e12", "batch 1e19", "tokens 2**32"],
)
def test_impossible_step_sizes_are_refused_up_front_in_one_line(
    small_llama_config: Path, capsys: pytest.CaptureFixture[str], sizes: list[str], message: str
) -> None:
    assert main(["check", "--hf-config", str(small_llama_config), "--memory", "--device", "cpu", *sizes]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_sequence_beyond_the_models_positions_is_a_warning_or_under_strict_refused(
    small_llama_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["check", "--hf-config", str(small_llama_config), "--memory", "--device", "cpu", "--batch", "1", "--seq-len", "64"]
    assert main(argv) == 0
    warning = "--seq-len 64 is longer than the model's max_position_embeddings 32"
    assert f"warning: {warning}: traced as given" in capsys.readouterr().err
    assert main([*argv, "--strict"]) == 2
    assert f"{warning} (--strict)" in capsys.readouterr().err
    assert main([*argv[:-1], "32"]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().err


def test_absurd_inputs_end_in_one_line_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    factory = ["meshbind.examples.moe_transformer:MoETransformer", "meshbind.examples.moe_transformer:loss_head_request"]
    for argv, message in [
        (["--hf-config", "/dev/zero"], "--hf-config /dev/zero: longer than 16,777,216 characters"),
        (["--hf-config", str(deep)], "its JSON is nested too deep to be a config"),
        ([*factory, "--html", ""], "--html '': an empty path names no file"),
    ]:
        assert main(["check", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_factory_that_exits_is_no_silent_success(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys
    import types

    module = types.ModuleType("exiting_models")
    module.build = lambda: sys.exit(0)  # type: ignore[attr-defined]
    module.plan = []  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "exiting_models", module)
    assert main(["check", "exiting_models:build", "exiting_models:plan"]) == 2
    assert "MODEL_FACTORY exiting_models:build called exit(0)" in capsys.readouterr().err


def test_malformed_safetensors_and_index_files_are_said_to_be_damaged(tmp_path: Path) -> None:
    import struct

    from meshbind.checkpoints import CheckpointError, stored_shapes

    cases = {
        "header a list": b"[1, 2]",
        "entry without a shape": b'{"w": {"dtype": "F32"}}',
        "nested too deep": b"[" * 100_000 + b"]" * 100_000,
    }
    for name, header in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
        with pytest.raises(CheckpointError, match=r"the checkpoint is damaged \(1 problem\)"):
            stored_shapes(folder)
    index = tmp_path / "index"
    index.mkdir()
    (index / "model.safetensors.index.json").write_text('{"weight_map": ["model.safetensors"]}')
    with pytest.raises(CheckpointError, match="its weight_map is not an object of file names"):
        stored_shapes(index)
