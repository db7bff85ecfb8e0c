"""Activation checkpointing as torchtitan applies it (``meshbind.activation_checkpointing``): which
blocks each choice wraps, what ``selective-op`` saves, and how a choice is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from meshbind import LayoutContext, resolve_plan
from meshbind.activation_checkpointing import apply_checkpointing
from meshbind.names import ActivationCheckpointing, Checkpointing

from hf_models import DENSE


class Blocks(nn.Module):
    def __init__(self, count: int = 5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 8, bias=False)) for _ in range(count)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _wrapped(text: str) -> list[int]:
    model = Blocks()
    plan = resolve_plan(model, [], LayoutContext({}), index=True)
    apply_checkpointing(model, plan, Checkpointing.parse(text, "activation_checkpointing"))
    return [index for index, layer in enumerate(model.layers) if isinstance(layer, CheckpointWrapper)]


def test_each_choice_wraps_the_blocks_torchtitan_wraps() -> None:
    assert _wrapped("none") == []
    assert _wrapped("full") == _wrapped("selective-op") == [0, 1, 2, 3, 4]
    assert _wrapped("selective-layer:1") == [0, 1, 2, 3, 4]
    assert _wrapped("selective-layer:2") == [1, 3]  # torchtitan counts from 1: the 2nd and 4th block
    assert _wrapped("selective-layer:3") == [2]
    assert _wrapped("selective-layer:9") == []


def test_selective_op_saves_the_listed_outputs_and_recomputes_every_second_mm() -> None:
    """torchtitan's policy: the listed operators' outputs are saved, every second ``mm`` of a
    block is recomputed (counted apart in its recomputation), anything else is recomputed; a
    model so wrapped gives the gradients of the unwrapped one."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from meshbind.activation_checkpointing import _every_second_mm_recomputed

    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    policy = _every_second_mm_recomputed()
    forward, again = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    aten = torch.ops.aten
    operators = [aten.mm.default, aten.relu.default, aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default]
    assert [policy(forward, op) for op in operators] == [save, recompute, recompute, save]
    assert [policy(again, op) for op in operators] == [save, recompute, recompute, save]
    assert [policy(forward, aten.mm.default), policy(forward, aten.mm.default)] == [save, recompute]

    torch.manual_seed(0)
    model, reference = Blocks(2), Blocks(2)
    reference.load_state_dict(model.state_dict())
    plan = resolve_plan(model, [], LayoutContext({}), index=True)
    apply_checkpointing(model, plan, Checkpointing.parse("selective-op", "activation_checkpointing"))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    reference(x).sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)


def test_a_choice_is_parsed_from_its_text_and_written_back_the_same() -> None:
    for text in ("none", "full", "selective-op", "selective-layer:1", "selective-layer:4"):
        assert str(Checkpointing.parse(text, "activation_checkpointing")) == text
    assert Checkpointing.parse("selective-layer:3", "x") == Checkpointing(ActivationCheckpointing.SELECTIVE_LAYER, 3)
    for wrong in (
        "selective",
        "selective-layer",
        "selective-layer:0",
        "selective-layer:-1",
        "full:2",
        "selective-layer:\uff12",
        2,
    ):
        with pytest.raises(ValueError, match=r"activation_checkpointing must be one of none, full, selective-layer:K"):
            Checkpointing.parse(wrong, "activation_checkpointing")


def test_the_command_line_takes_each_form_and_names_the_forms_on_a_wrong_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``check --memory --activation-checkpointing``: a selective choice is traced and said in the
    answer; a wrong one exits 2 naming the forms, before any work."""
    from meshbind.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4, **DENSE}))
    argv = ["check", "--hf-config", str(config), "--axis", "dp_shard=2", "--memory", "--batch", "1", "--seq-len", "32"]
    assert main([*argv, "--activation-checkpointing", "selective-layer:2", "--device", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["activation_checkpointing"] == "selective-layer:2"
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--activation-checkpointing", "selective-layer:0"])
    assert exited.value.code == 2
    assert (
        "the choice must be one of none, full, selective-layer:K (K a whole number from 1), selective-op"
        in capsys.readouterr().err
    )


def test_param_dtype_builds_a_transformers_config_in_float32(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """FSDP2's mixed precision keeps float32 shards: a config stored in bfloat16 is built in float32."""
    from meshbind.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "torch_dtype": "bfloat16", **DENSE}))
    argv = ["check", "--hf-config", str(config), "--axis", "dp_shard=2", "--report"]
    assert main([*argv, "--param-dtype", "bf16", "--reduce-dtype", "fp32"]) == 0
    captured = capsys.readouterr()
    assert "float32 -> bfloat16, reduced in float32" in captured.out and "in float32 (--param-dtype)" in captured.err
    assert main(argv) == 0
    assert "bfloat16 -> bfloat16, reduced in bfloat16" in capsys.readouterr().out
