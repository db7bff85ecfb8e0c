"""Saving a model's state: into an empty, missing or meshbind-written folder only, every rank its
own shards, published whole once every rank has written (a save killed at any point leaves the
previous checkpoint as it was)."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.tensor import DTensor

from meshbind.checkpoints.files import (
    MANIFEST,
    MARK,
    SINGLE_PROCESS,
    aside_of,
    file_entry,
    gathered,
    in_world,
    json_object,
    staging_of,
)
from meshbind.checkpoints.parts import Models, agree_on, merged_state, parts_of
from meshbind.errors import CheckpointError
from meshbind.mesh import MeshContext


def save_target_problem(directory: str | os.PathLike[str]) -> str | None:
    """Why a save may not write ``directory``, or ``None``. A save replaces its folder whole, so it
    writes only a missing folder (under one it can create), an empty one, or a meshbind checkpoint
    holding nothing but its manifest's files: never the working directory, a folder with other
    files in it, or beside a file that takes its staging name."""
    target = Path(directory)
    here = Path.cwd().resolve()
    resolved = target.resolve()
    if resolved == here or resolved in here.parents:
        return f"{os.fspath(directory)}: is the working directory or holds it: save into a folder of its own"
    for side in (staging_of(target), aside_of(target)):
        if side.exists() and not side.is_dir():
            return f"{os.fspath(side)} is a file, and a save needs that name for its own folder: move the file away"
    if not target.exists():
        ancestor = resolved.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
            return f"{os.fspath(directory)}: cannot be made ({os.fspath(ancestor)} is not a folder this process can write)"
        return None
    if not target.is_dir():
        return f"{os.fspath(directory)}: is a file, not a folder"
    present = sorted(entry.name for entry in target.iterdir())
    manifest = target / MANIFEST
    files: Any = {}
    if manifest.is_file():
        try:
            files = json_object(manifest).get("files", {})
        except CheckpointError:  # a damaged manifest vouches for no file
            files = {}
    foreign = [name for name in present if name != MANIFEST and (not isinstance(files, dict) or name not in files)]
    if not foreign:
        return None
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    kind = "a meshbind checkpoint with other files in it" if manifest.is_file() else "not a meshbind checkpoint"
    return (
        f"{os.fspath(directory)}: is {kind} ({shown}), and a save replaces the whole folder: save into an empty "
        "or a new folder, or move those away"
    )


def save_checkpoint(model: Models, directory: str | os.PathLike[str], *, mesh_context: MeshContext | None = None) -> None:
    """Write the model's state (DTensors as their shards) to ``directory``, replacing what was
    there only once the new state is complete; every rank calls it (in a process with no world,
    that process alone writes it). A non-finite value on any rank refuses the save on every rank,
    and so does a folder ``save_target_problem`` refuses, before anything is written. Under a
    pipeline ``model`` is the rank's stage models and ``mesh_context`` its meshes: each stage's
    ranks write its modules, under the whole model's FQNs, so any layout loads it."""
    target = Path(directory)
    refused = save_target_problem(target)
    if refused is not None:
        raise CheckpointError([refused], "the save is refused before anything is written", "reason")
    parts = parts_of(model)
    agree_on("save_checkpoint", parts, target, mesh_context)
    state = merged_state(parts)
    _refuse_non_finite(state)
    state[MARK] = "format 1"
    rank = dist.get_rank() if in_world() else 0
    staging = staging_of(target)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
        staging.mkdir(parents=True)
    if in_world():
        dist.barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", SINGLE_PROCESS)
        save(state, checkpoint_id=staging)
    own = sorted(path.name for path in staging.glob(f"__{rank}_*"))
    reported = gathered({name: file_entry(staging / name) for name in own})  # every rank's shards are written
    if rank == 0:
        files = {name: entry for entries in reported for name, entry in entries.items()}
        files[".metadata"] = file_entry(staging / ".metadata")
        _write_durably(staging / MANIFEST, json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True))
        _publish(staging, target)
    if in_world():
        dist.barrier()  # no rank returns before the new checkpoint is in place


def _refuse_non_finite(state: dict[str, Any]) -> None:
    """A NaN or infinity in any floating tensor of any rank's shard refuses the save everywhere."""
    first = None
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            local = value.to_local() if isinstance(value, DTensor) else value
            if not bool(torch.isfinite(local).all()):
                first = key
                break
    found = [(rank, key) for rank, key in enumerate(gathered(first)) if key is not None]
    if found:
        raise CheckpointError(
            [f"{key!r} holds a non-finite value (NaN or infinity) on rank {rank}" for rank, key in found]
            + ["the previous checkpoint, if any, is left as it was"],
            "the save is refused",
            "reason",
        )


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _publish(staging: Path, target: Path) -> None:
    """Put the complete ``staging`` folder in ``target``'s place. Between the two renames the target
    is absent, never a mix: the old folder is whole beside it until the new one is in place."""
    aside = aside_of(target)
    shutil.rmtree(aside, ignore_errors=True)
    if target.exists():
        os.rename(target, aside)
    os.rename(staging, target)
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    shutil.rmtree(aside, ignore_errors=True)
