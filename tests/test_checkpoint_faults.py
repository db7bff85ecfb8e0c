"""Checkpoints are atomic and verified (SPEC §10), shown by causing the faults: a rank killed at
each phase of a save on a real gloo world, over an existing checkpoint and into a new folder;
flipped bytes, deleted and truncated files, stale files and non-finite values."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from checkpoint_faults import PHASES, loss_of, model_of
from torch import nn

from meshbind.checkpoints import MANIFEST, CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint
from meshbind.cli import main
from meshbind.launch import run_local_world


def loaded_loss(directory: Path) -> float:
    model = model_of(99, sharded=False)
    load_checkpoint(model, directory, no_dist=True)
    return loss_of(model)


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("over_existing", [True, False], ids=["over an existing checkpoint", "into a new folder"])
def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint_whole(
    tmp_path: Path, phase: str, over_existing: bool
) -> None:
    target = tmp_path / "checkpoint"
    if over_existing:
        (saved,) = set(run_local_world(2, "checkpoint_faults:save_then_die", str(target), 1, None, timeout=60))
        assert loaded_loss(target) == saved
    with pytest.raises(RuntimeError, match="died without a result"):
        run_local_world(2, "checkpoint_faults:save_then_die", str(target), 2, phase, timeout=60)
    if over_existing:
        assert verify_checkpoint(target) and loaded_loss(target) == saved  # the old state, whole
    else:
        assert not target.exists()
    # The next save goes through, whatever the killed one left beside the target.
    (again,) = set(run_local_world(2, "checkpoint_faults:save_then_die", str(target), 3, None, timeout=60))
    assert loaded_loss(target) == again != loss_of(model_of(2, sharded=False))


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    save_checkpoint(model_of(1, sharded=False), tmp_path / "checkpoint")
    return tmp_path / "checkpoint"


def checking_command(monkeypatch: pytest.MonkeyPatch, saved: Path) -> list[str]:
    """``meshbind check`` of the faults' model (a Linear(8, 8), no plan) against ``saved``."""
    module = types.ModuleType("fault_models")
    module.linear = lambda: nn.Linear(8, 8)  # type: ignore[attr-defined]
    module.plan = []  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fault_models", module)
    return ["check", "fault_models:linear", "fault_models:plan", "--axis", "tp=1", "--checkpoint", str(saved)]


def shard_of(directory: Path) -> Path:
    (shard,) = directory.glob("*.distcp")
    return shard


def refused(directory: Path, *expected: str) -> None:
    """Loading is refused naming each of ``expected``, the model unchanged; ``check --checkpoint`` exits 1."""
    model = model_of(99, sharded=False)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(model, directory, no_dist=True)
    for text in expected:
        assert text in str(caught.value), str(caught.value)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_a_save_writes_a_manifest_that_the_load_verifies(saved: Path) -> None:
    manifest = json.loads((saved / MANIFEST).read_text())
    assert set(manifest["files"]) == {".metadata", shard_of(saved).name}
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] > 0 for entry in manifest["files"].values())
    assert verify_checkpoint(saved) and loaded_loss(saved) == loss_of(model_of(1, sharded=False))
    assert not list(saved.parent.glob(".checkpoint.*"))  # nothing left beside it


def test_flipped_bytes_are_named_before_any_tensor_changes(saved: Path) -> None:
    shard = shard_of(saved)
    data = bytearray(shard.read_bytes())
    data[100:116] = bytes(255 - b for b in data[100:116])
    shard.write_bytes(bytes(data))
    refused(saved, f"'{shard.name}': its sha256 differs from the manifest's (damaged)")


def test_a_deleted_or_truncated_file_is_named_with_or_without_a_manifest(saved: Path) -> None:
    shard = shard_of(saved)
    metadata = (saved / ".metadata").read_bytes()
    (saved / ".metadata").write_bytes(metadata[: len(metadata) // 2])
    refused(saved, f"'.metadata': {len(metadata) // 2} bytes, the manifest says {len(metadata)} (truncated or replaced)")
    (saved / MANIFEST).unlink()  # as plain torch.distributed.checkpoint would have left it
    refused(saved, "/.metadata' is unreadable torch.distributed.checkpoint metadata")
    (saved / ".metadata").write_bytes(b"")
    refused(saved, "/.metadata' is unreadable torch.distributed.checkpoint metadata")
    (saved / ".metadata").write_bytes(metadata)
    shard.unlink()
    refused(saved, f"{shard.name}': the metadata stores tensors there, but it is missing")


def test_a_file_another_save_left_is_named(saved: Path) -> None:
    shutil.copy(shard_of(saved), saved / "__1_0.distcp")
    refused(saved, "'__1_0.distcp': not in the manifest (left by another save?)")


def test_a_non_finite_value_refuses_the_save_and_keeps_the_previous_checkpoint(saved: Path) -> None:
    model = model_of(2, sharded=False)
    with torch.no_grad():
        model.weight[3, 4] = float("nan")
    with pytest.raises(CheckpointError, match=r"'weight' holds a non-finite value \(NaN or infinity\) on rank 0"):
        save_checkpoint(model, saved)
    assert loaded_loss(saved) == loss_of(model_of(1, sharded=False))


def test_a_meshbind_checkpoint_whose_manifest_is_gone_is_refused_unless_allowed(
    saved: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (saved / MANIFEST).unlink()
    shard = shard_of(saved)
    data = bytearray(shard.read_bytes())
    data[-40:-24] = bytes(255 - byte for byte in data[-40:-24])  # 16 flipped bytes, unseen without the manifest
    shard.write_bytes(bytes(data))
    model = model_of(99, sharded=False)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"by meshbind \(its \.metadata says so\), but its meshbind-manifest.json is gone"):
        load_checkpoint(model, saved, no_dist=True)
    assert torch.equal(model.weight, before)
    check_arguments = checking_command(monkeypatch, saved)
    arguments = check_arguments
    assert main(arguments) == 1
    assert "--allow-unverified" in capsys.readouterr().err
    assert main([*arguments, "--allow-unverified"]) == 0
    assert "fits the model (unverified" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="loaded without verifying its files"):
        load_checkpoint(model, saved, no_dist=True, allow_unverified=True)


def test_a_checkpoint_another_tool_wrote_loads_said_to_be_unverified(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import save

    written = model_of(1, sharded=False)
    with pytest.warns(UserWarning):  # torch's own: a save without a process group
        save(written.state_dict(), checkpoint_id=tmp_path / "plain-dcp", no_dist=True)
    with pytest.warns(UserWarning, match="has no meshbind-manifest.json: loaded without verifying its files"):
        assert loaded_loss(tmp_path / "plain-dcp") == loss_of(written)


def test_check_checkpoint_names_a_damaged_file_and_says_what_it_verified(
    saved: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    check_arguments = checking_command(monkeypatch, saved)
    arguments = check_arguments
    assert main(arguments) == 0
    assert "fits the model (every file verified against its manifest)" in capsys.readouterr().err
    shard = shard_of(saved)
    shard.write_bytes(shard.read_bytes()[:-1])
    assert main(arguments) == 1
    assert f"'{shard.name}': " in capsys.readouterr().err


def test_a_save_stopped_between_its_two_renames_says_where_the_previous_checkpoint_is(saved: Path) -> None:
    aside = saved.parent / f".{saved.name}.replaced"
    saved.rename(aside)  # what a save killed after moving the old folder aside, before the new one took its place
    refused(saved, f"is missing: a save was stopped while replacing it, and the previous checkpoint is whole in '{aside}'")


def test_the_demo_refuses_to_save_a_nan_state(tmp_path: Path) -> None:
    # `meshbind demo --lr nan --save DIR` once wrote a NaN state with exit 0.
    from meshbind.demo import run as demo
    from meshbind.demo.config import DemoConfig

    with pytest.raises(RuntimeError, match=r"holds a non-finite value \(NaN or infinity\) on rank"):
        demo.run_local(DemoConfig(world_size=2, cp=2, tp=1, ep=2, lr=float("nan"), save=str(tmp_path / "state")))
    assert not (tmp_path / "state").exists()


def tree_of(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): path.read_text() if path.is_file() else "/" for path in sorted(folder.rglob("*"))}


def test_a_save_into_a_folder_of_other_files_is_refused_before_any_work_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True)
    (run / "notes.txt").write_text("precious")
    before = tree_of(tmp_path)
    assert main(["demo", "--world-size", "2", "--cp", "1", "--tp", "2", "--ep", "2", "--save", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"--save {run}: is not a meshbind checkpoint (notes.txt, sub)" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(CheckpointError, match=r"the save is refused before anything is written \(1 reason\)"):
        save_checkpoint(model_of(1, sharded=False), run)
    assert tree_of(tmp_path) == before
    monkeypatch.chdir(run)
    assert main(["demo", "--world-size", "2", "--cp", "1", "--tp", "2", "--ep", "2", "--save", "."]) == 2
    assert "--save .: is the working directory or holds it" in capsys.readouterr().err
    (tmp_path / ".new.saving").write_text("a file in the staging folder's place")
    assert main(["demo", "--world-size", "2", "--cp", "1", "--tp", "2", "--ep", "2", "--save", str(tmp_path / "new")]) == 2
    assert f"{tmp_path / '.new.saving'} is a file, and a save needs that name" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_checkpoint_folder_with_a_file_of_the_users_is_refused_and_a_bare_checkpoint_replaced(saved: Path) -> None:
    (saved / "notes.txt").write_text("precious")
    with pytest.raises(CheckpointError, match=r"is a meshbind checkpoint with other files in it \(notes.txt\)"):
        save_checkpoint(model_of(2, sharded=False), saved)
    assert (saved / "notes.txt").read_text() == "precious"
    (saved / "notes.txt").unlink()
    save_checkpoint(model_of(2, sharded=False), saved)
    assert verify_checkpoint(saved, no_dist=True) and loaded_loss(saved) == loss_of(model_of(2, sharded=False))


class Payload:
    """What a crafted ``.metadata`` carries: code that ``pickle.load`` would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


@pytest.mark.parametrize("inside", [False, True], ids=["the whole file", "inside real metadata"])
def test_check_and_load_never_run_code_from_metadata(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, inside: bool
) -> None:
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    marker = tmp_path / "payload-ran"
    (saved / MANIFEST).unlink()  # a checkpoint written elsewhere: nothing to verify its files against
    crafted: object = Payload(marker)
    if inside:
        crafted = Metadata(state_dict_metadata={"weight": Payload(marker)})  # type: ignore[dict-item]
    (saved / ".metadata").write_bytes(pickle.dumps(crafted))
    check_arguments = checking_command(monkeypatch, saved)
    assert main(check_arguments) == 1
    assert "it names builtins.exec, which no checkpoint metadata holds; refused unread" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="refused unread"):
        load_checkpoint(model_of(1, sharded=False), saved, no_dist=True)
    assert not marker.exists()
