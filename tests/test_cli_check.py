"""SPEC §7 ``meshbind check``: offline pre-flight of a plan against a model built on meta."""

from __future__ import annotations

import json
import re

import pytest

from meshbind.cli import main

MODEL = "meshbind.examples.moe_tree:small_moe_tree"
PLAN = "meshbind.examples.moe_tree:deep_plan_requests"


def test_a_valid_plan_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", MODEL, PLAN, "--axis", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert "layers.3.mlp.experts.7.down_proj" in out and "118 planned modules; layout tp=2" in out


def test_every_problem_is_printed_with_a_failing_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", MODEL, PLAN, "--axis", "ep=2"]) == 1
    err = capsys.readouterr().err
    assert "the plan has 118 problems" in err and "which the layout context lacks (axes: ep)" in err


def test_json_output_is_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", MODEL, PLAN, "--axis", "ep=2", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and len(report["problems"]) == 118
    assert report["problems"][0]["code"] == "layout"
    assert main(["check", MODEL, PLAN, "--axis", "tp=1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and len(report["plan"]["modules"]) == 118


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["check", "meshbind.examples.moe_tree", PLAN], "must be written module:attribute"),
        (["check", "meshbind.nowhere:f", PLAN], "cannot import 'meshbind.nowhere'"),
        (["check", "meshbind.examples.moe_tree:nothing", PLAN], "has no attribute 'nothing'"),
        (["check", "meshbind.examples.moe_tree:DEEP_PLAN", PLAN], "is not callable"),
        (
            ["check", MODEL, "meshbind.examples.moe_tree:DEEP_PLAN"],
            "must be, or return, a sequence of NativeParallelBindingRequest",
        ),
        (["check", MODEL, "math:pi"], "must be, or return, a sequence of NativeParallelBindingRequest"),
        (["check", MODEL, PLAN, "--axis", "ep=2", "--axis", "tp=1", "--axis", "ep=4"], "--axis ep is given more than once"),
    ],
)
def test_bad_references_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshbind check: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err)


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
    assert main(["check", model, plan, "--axis", "dp=1", "--axis", "cp=2", "--axis", "ep=3"]) == 1
    assert "num_experts 8 is not divisible by the 'ep' axis size 3" in capsys.readouterr().err
