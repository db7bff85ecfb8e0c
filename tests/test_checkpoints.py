"""Checkpoints reshard (SPEC §8): the demo's state saved at one layout loads at another, or in
one process, and gives the saved run's updated loss; a checkpoint that does not fit is refused
naming every key, before anything changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from meshbind.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from meshbind.demo import run as demo
from meshbind.demo.config import DemoConfig


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    """One SGD step under FSDP on 8 ranks (dp_shard=2, cp=2, tp=2, ep=4), saved."""
    directory = tmp_path_factory.mktemp("checkpoint")
    report = demo.run_local(DemoConfig(world_size=8, dp_shard=2, ep=4, dtype="float64", save=str(directory)))
    return directory, report


@pytest.mark.parametrize(
    "layout",
    [
        {"world_size": 4, "dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 2},
        {"world_size": 4, "dp_shard": 4, "cp": 1, "tp": 1, "ep": 4},
        {"world_size": 4, "dp_replicate": 2, "cp": 1, "tp": 2, "ep": 2},
        {"world_size": 1, "cp": 1, "tp": 1, "ep": 1},
    ],
    ids=["hsdp-dp_replicate2-dp_shard2-ep2", "fsdp-dp_shard4-ep4", "replicated-dp2-tp2-ep2", "one-process"],
)
def test_the_state_saved_at_one_layout_loads_at_another(saved: tuple[Path, dict[str, float]], layout: dict[str, int]) -> None:
    directory, report = saved
    assert abs(report["loss_after_step"] - report["loss"]) > 1e-3  # the step changed the model
    loaded = demo.run_local(DemoConfig(dtype="float64", load=str(directory), **layout))
    assert abs(loaded["loss"] - report["loss_after_step"]) <= 1e-12
    # The single-process reference loads the same state.
    assert abs(loaded["reference_loss"] - report["loss_after_step"]) <= 1e-12
    assert loaded["max_rel_grad_diff"] <= 1e-10


def test_a_checkpoint_for_another_model_is_refused_naming_every_key(saved: tuple[Path, dict[str, float]]) -> None:
    directory, _ = saved
    with pytest.raises(RuntimeError) as failed:
        demo.run_local(DemoConfig(dtype="float64", load=str(directory), experts=16))
    text = str(failed.value)
    assert "the checkpoint does not fit the model (8 keys)" in text
    for layer in (0, 1):
        for name in ("w_gate", "w_up", "w_down", "router.weight"):
            assert f"'blocks.{layer}.moe.{name}': the checkpoint's shape" in text


class Small(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(4, width)
        self.b = nn.Linear(width, 2)


def test_a_misfit_names_every_key_and_changes_nothing(tmp_path: Path) -> None:
    save_checkpoint(Small(3), tmp_path)
    model = Small(5)
    model.c = nn.Linear(2, 2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(model, tmp_path, no_dist=True)
    problems = refused.value.problems
    assert refused.value.code == "checkpoint" and isinstance(refused.value, ValueError)
    keys = sorted(problem.split(":")[0] for problem in problems)
    assert keys == ["'a.bias'", "'a.weight'", "'b.weight'", "'c.bias'", "'c.weight'"]
    assert "'c.weight': not in the checkpoint" in problems
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())
    fitting = Small(3)
    load_checkpoint(fitting, tmp_path, no_dist=True)


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        CheckpointError, match=r"is neither a torch\.distributed\.checkpoint directory \(no \.metadata\) nor a safetensors one"
    ):
        load_checkpoint(Small(3), tmp_path, no_dist=True)


def test_the_demo_refuses_its_own_checkpoint_once_the_manifest_is_gone_unless_allowed(
    saved: tuple[Path, dict[str, float]], tmp_path: Path
) -> None:
    import shutil

    from meshbind.checkpoints import MANIFEST

    directory, report = saved
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    (copy / MANIFEST).unlink()
    layout = {"world_size": 2, "cp": 1, "tp": 1, "ep": 2, "dp_shard": 2, "dtype": "float64"}
    with pytest.raises(RuntimeError, match="the checkpoint is refused unverified"):
        demo.run_local(DemoConfig(load=str(copy), **layout))  # type: ignore[arg-type]
    loaded = demo.run_local(DemoConfig(load=str(copy), allow_unverified=True, **layout))  # type: ignore[arg-type]
    assert abs(loaded["loss"] - report["loss_after_step"]) <= 1e-12
