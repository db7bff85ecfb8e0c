"""The main job (SPEC §7 ``meshbind demo``): distributed runs against the one-process reference,
the torchrun entry, and every flag error before any process starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from meshbind.cli import main
from meshbind.demo import run as demo
from meshbind.demo.config import DemoConfig
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, batch
from meshbind.launch import free_port

LAYOUTS = {
    "4-ranks-cp2-tp2-ep2 (the default)": {},
    # One sequence per data-parallel rank: every dim before the sequence has size 1 in the CP gathers.
    "4-ranks-dp2-ep2-b2": dict(dp_replicate=2, cp=2, tp=1, ep=2, batch=2),
    "2-ranks": dict(world_size=2, cp=2, tp=1, ep=2, layers=3),
    "4-ranks-dp4-ep1": dict(dp_replicate=4, cp=1, tp=1, ep=1),  # no expert mesh built: the demo wraps one
    "4-ranks-tp4-ep4": dict(cp=1, tp=4, ep=4),  # one head per tp rank
    # FSDP2 over dp_shard * cp = 4 with tp, the experts over edp_shard = 2 (SPEC §10).
    "8-ranks-fsdp-dp_shard2-cp2-tp2-ep4": dict(world_size=8, dp_shard=2, cp=2, tp=2, ep=4),
    "4-ranks-hsdp-dp_replicate2-dp_shard2-ep2": dict(dp_replicate=2, dp_shard=2, cp=1, tp=1, ep=2),
}
BOUNDS = {"float32": 1e-5, "float64": 1e-10}
"""The largest relative gradient difference from one process: float32 is the demo's default dtype."""


@pytest.mark.parametrize("dtype", list(BOUNDS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_distributed_run_matches_one_process(layout: str, dtype: str) -> None:
    config, bound = DemoConfig(**LAYOUTS[layout], dtype=dtype), BOUNDS[dtype]  # type: ignore[arg-type]
    report = demo.run_local(config)
    assert report["world_size"] == config.world_size and report["dtype"] == config.dtype
    assert report["axis_sizes"] == config.world.axis_sizes()
    assert report["new_process_groups"] == 0
    # What plan_report predicted from the plan on meta is what each rank's parameters hold.
    assert report["report_matches_every_rank"] and report["report_param_bytes_per_rank"] == report["param_bytes_per_rank"]
    assert report["modules_bound"] == 2 * config.layers + 1
    assert report["max_rel_grad_diff"] <= bound
    assert report["max_abs_loss_diff"] <= bound * 10
    assert isinstance(report["seconds_total"], float)
    # Each rank holds E / ep of every fused expert weight and heads / tp of every attention
    # projection, and under FSDP a 1 / edp_shard (experts) or 1 / (dp_shard * cp) (the rest) of
    # that: exactly those bytes are saved.
    transformer, element = config.transformer, 4 if config.dtype == "float32" else 8
    world = config.world
    expert_divisor = config.ep * (world.edp_shard if config.fsdp else 1)
    dense_divisor = world.fsdp_shard if config.fsdp else 1
    expert_bytes = 3 * transformer.layers * transformer.experts * transformer.intermediate * transformer.hidden * element
    attention_bytes = 4 * transformer.layers * transformer.hidden**2 * element  # qkv (3h x h) and out (h x h)
    parts = report["param_bytes_by_part"]
    assert parts["experts"] == [expert_bytes // expert_divisor, expert_bytes]
    assert parts["attention"] == [attention_bytes // (config.tp * dense_divisor), attention_bytes]
    router_bytes = transformer.layers * transformer.experts * transformer.hidden * element  # on the expert mesh
    router_divisor = world.edp_shard if config.fsdp else 1
    assert parts["other"][0] == (parts["other"][1] - router_bytes) // dense_divisor + router_bytes // router_divisor
    assert report["param_bytes_per_rank"] == sum(mine for mine, _ in parts.values())
    assert set(report["phases"]) >= {"mesh", "build", "plan", "bind", "materialise", "validate", "forward", "backward"}


def test_mixed_precision_matches_the_reference_under_the_same_casts_as_closely_as_the_casts_move_it() -> None:
    """``--param-dtype bf16``: FSDP2 gathers and computes in bfloat16 and reduces in float32; the
    reference runs the same casts in one process. Both round differently (the batch split over
    ranks, float32 sums), so the bound is the casts' own error on the same run: how far the
    reference under the casts is from the float32 reference. The loss agrees to a few bfloat16
    steps (one is 2**-7 of its value)."""
    config = DemoConfig(dp_shard=2, cp=1, tp=2, ep=2, param_dtype="bf16")
    report = demo.run_local(config)
    assert report["param_dtype"] == "bf16" and report["report_matches_every_rank"]
    assert 0 < report["cast_rel_grad_diff"] < 0.5
    assert report["max_rel_grad_diff"] <= 2 * report["cast_rel_grad_diff"], report
    assert report["max_abs_loss_diff"] <= 4 * 2**-7 * abs(report["reference_loss"])


def test_the_command_prints_the_plan_and_ends_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--world-size", "2", "--dp", "1", "--cp", "2", "--tp", "1", "--ep", "2", "--seq-len", "16", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["new_process_groups"] == 0 and report["max_rel_grad_diff"] <= 1e-5
    assert {"world_size", "axis_sizes", "dtype", "modules_bound", "max_abs_loss_diff", "phases"} <= set(report)
    assert any(line.startswith("blocks.0.attn") and "cp_causal_attention" in line for line in lines)
    assert "spawning 2 ranks" in captured.err


@pytest.mark.skipif(
    shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
    reason="no torchrun",
)
def test_torchrun_runs_the_distributed_half() -> None:
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "meshbind.demo",
        "--dp",
        "1",
        "--cp",
        "2",
        "--tp",
        "1",
        "--ep",
        "2",
        "--dtype",
        "float64",
        "--json",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["world_size"] == 2 and report["new_process_groups"] == 0 and report["max_rel_grad_diff"] <= 1e-10
    assert "[meshbind demo] bind ..." in result.stderr  # progress per phase, from rank 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dp", "1", "--cp", "2", "--tp", "1"], "--dp-replicate 1 x --dp-shard 1 x --cp 2 x --tp 1 = 2, not the world size 4"),
        (["--experts", "6", "--ep", "4", "--tp", "2"], "--experts 6 is not divisible by the 'ep' axis size 4"),
        (["--ep", "3"], "ep=3 does not divide dp_shard * cp * tp = 1 * 2 * 2 = 4"),
        (["--dp", "2", "--cp", "2", "--tp", "1", "--ep", "4"], "dp_replicate=2 replicates the experts, it lends them no ranks"),
        (
            ["--world-size", "3", "--cp", "1", "--tp", "3", "--ep", "1", "--experts", "6"],
            "the model's attention heads 4 is not divisible by the 'tp' axis size 3",
        ),
        (["--seq-len", "30"], "--seq-len 30 is not divisible by 2 x --cp = 4"),
        (["--world-size", "4096", "--dp", "1024", "--cp", "2", "--tp", "2"], "more than this machine can sensibly run"),
        (
            ["--batch", "3", "--dp", "2", "--cp", "2", "--tp", "1"],
            "--batch 3 is not divisible by --dp-replicate x --dp-shard = 2",
        ),
        (
            ["--batch", "2", "--dp-replicate", "2", "--dp-shard", "2", "--cp", "1", "--tp", "1"],
            "--batch 2 is not divisible by --dp-replicate x --dp-shard = 4",
        ),
        (["--layers", "0"], "--layers must be at least 1"),
        (["--load", "/nonexistent/checkpoint"], "--load /nonexistent/checkpoint is not a checkpoint written by --save"),
        (["--experts", "1", "--ep", "1"], "fewer than the 2 experts each token is routed to"),
        (["--layers", "100000"], "--layers 100000 is over the demo's limit of 64"),
        (["--experts", "1000000"], "--experts 1000000 is over the demo's limit of 1024"),
        (["--seq-len", "1000000000"], "--seq-len 1000000000 is over the demo's limit of 65536"),
        (["--batch", "4096", "--seq-len", "4096"], "--batch 4096 x --seq-len 4096 is 16,777,216 tokens, over the demo's limit"),
        (["--seed", str(10**23)], f"--seed {10**23} must be from 0 to 2**63 - 1"),
        (["--lr", "nan"], "--lr nan must be a positive, finite learning rate"),
        (["--lr", "inf"], "--lr inf must be a positive, finite learning rate"),
        (["--param-dtype", "bf16"], "--param-dtype bf16 is FSDP2's mixed precision: it needs --dp-shard above 1"),
    ],
)
def test_bad_flags_fail_before_any_process_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_world(config: DemoConfig) -> None:
        raise AssertionError("a world was started")

    monkeypatch.setattr(demo, "run_local", no_world)
    assert main(["demo", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshbind demo: ") and len(err.splitlines()) == 1
    assert message in err


def test_a_bad_dtype_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--dtype", "float16"])
    assert exited.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err


def test_a_failed_world_is_reported_with_its_ranks_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_world(config: DemoConfig) -> None:
        raise RuntimeError(
            "meshbind.demo.run:_spawned_rank failed:\nrank 1:\nTraceback (most recent call last):\nValueError: boom"
        )

    monkeypatch.setattr(demo, "run_local", failing_world)
    assert main(["demo"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("meshbind demo: meshbind.demo.run:_spawned_rank failed:")
        and "rank 1:" in err
        and "ValueError: boom" in err
    )
    assert "commands.py" not in err  # the rank's traceback, not the command line's own


def test_a_parameter_no_gradient_reached_is_named_before_any_reduction() -> None:
    model = MoETransformer(TransformerConfig(layers=1, experts=4))
    tokens, targets = batch(model.config, 1, 8, seed=0)
    model(tokens, targets).backward()
    model.norm.weight.grad = None
    with pytest.raises(RuntimeError, match=r"^rank 3: no gradient reached 'norm.weight'$"):
        demo._local_gradients(model, 3)


@pytest.mark.skipif(
    shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
    reason="no torchrun",
)
def test_two_torchrun_agents_run_hsdp_as_two_nodes() -> None:
    # Two agents on this machine, as on two hosts: c10d rendezvous, 2 ranks each. HSDP replicates
    # across the agents (dp_replicate, outermost) and shards within each (dp_shard).
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    endpoint = f"127.0.0.1:{free_port()}"
    command = [
        torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", "meshbind-two-nodes", "-m", "meshbind.demo",
        "--dp-replicate", "2", "--dp-shard", "2", "--cp", "1", "--tp", "1", "--ep", "2", "--dtype", "float64", "--json",
    ]  # fmt: skip
    agents = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=240) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], [err[-3000:] for _, err in outputs]
    (report,) = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs if out.strip()]
    assert report["axis_sizes"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 2}
    nodes = report["node_of_rank"]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # each replica of the shards on its own node
    assert report["max_rel_grad_diff"] <= 1e-10 and report["new_process_groups"] == 0 and report["report_matches_every_rank"]


def test_ctrl_c_stops_the_world_in_one_line_and_leaves_no_process() -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, once the ranks run."""
    import signal
    import time

    command = [sys.executable, "-m", "meshbind", "demo"]
    process = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal, not a background job
    )
    assert process.stderr is not None
    seen = []
    for line in process.stderr:
        seen.append(line)
        if "] mesh ..." in line:  # every rank has started
            break
    os.killpg(process.pid, signal.SIGINT)
    rest = process.stderr.read()
    assert process.wait(timeout=60) == 130
    err = "".join(seen) + rest
    assert "meshbind demo: interrupted" in err and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-g", str(process.pid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a process of the demo outlived it"
        time.sleep(0.5)
