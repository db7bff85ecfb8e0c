"""Checkpoints that reshard, written atomically and verified: a model's state
saved under one layout with ``torch.distributed.checkpoint`` loads under another, after a check
that it is whole and that it fits.

Every rank enters ``save_checkpoint`` and writes its own shards (gathering a DTensor is a
collective, so a save that only rank 0 enters would hang). The shards and DCP's ``.metadata`` go
into a fresh folder beside the target; each rank records its files' sizes and sha256 digests,
rank 0 writes them to a manifest, and only once every rank has reported does rank 0 put the new
folder in the target's place (the old one moved aside, then removed). A save killed at any point
leaves the previous checkpoint as it was. ``load_checkpoint`` first verifies the manifest (every
file there, at its size and digest, and no other), then compares the metadata with the model's
state dict — every key the model has must be there, at its global shape — and names every
problem at once before any tensor changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.tensor import DTensor

from meshbind.agreement import check_ranks_agree, model_entries
from meshbind.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "Misfit",
    "checkpoint_fit",
    "checkpoint_misfits",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]


_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
"""torch's warning when a checkpoint is read or written by one process, which here is meant."""
MANIFEST = "meshbind-manifest.json"
"""Each file of a checkpoint with its size and sha256, written last, by rank 0."""
MARK = "meshbind-checkpoint"
"""The key a meshbind save adds to the state it writes: its ``.metadata`` then says who wrote it,
so a checkpoint whose manifest is gone is known for what it is."""
_CHUNK = 1 << 22


def _in_world() -> bool:
    return dist.is_available() and dist.is_initialized()


def _gathered(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (one process: itself)."""
    if not _in_world():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


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
    for side in (_staging(target), _aside(target)):
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
            files = _json(manifest).get("files", {})
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


def _staging(target: Path) -> Path:
    return target.parent / f".{target.name}.saving"


def _aside(target: Path) -> Path:
    return target.parent / f".{target.name}.replaced"


def save_checkpoint(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Write the model's state (DTensors as their shards) to ``directory``, replacing what was
    there only once the new state is complete; every rank calls it (in a process with no world,
    that process alone writes it). A non-finite value on any rank refuses the save on every rank,
    and so does a folder ``save_target_problem`` refuses, before anything is written."""
    target = Path(directory)
    refused = save_target_problem(target)
    if refused is not None:
        raise CheckpointError([refused], "the save is refused before anything is written", "reason")
    check_ranks_agree("save_checkpoint", lambda: [*model_entries(model), ("checkpoint", os.fspath(target))])
    state = model.state_dict()
    _refuse_non_finite(state)
    state[MARK] = "format 1"
    rank = dist.get_rank() if _in_world() else 0
    staging = _staging(target)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
        staging.mkdir(parents=True)
    if _in_world():
        dist.barrier()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _SINGLE_PROCESS)
        save(state, checkpoint_id=staging)
    own = sorted(path.name for path in staging.glob(f"__{rank}_*"))
    reported = _gathered({name: _file_entry(staging / name) for name in own})  # every rank's shards are written
    if rank == 0:
        files = {name: entry for entries in reported for name, entry in entries.items()}
        files[".metadata"] = _file_entry(staging / ".metadata")
        _write_durably(staging / MANIFEST, json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True))
        _publish(staging, target)
    if _in_world():
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
    found = [(rank, key) for rank, key in enumerate(_gathered(first)) if key is not None]
    if found:
        raise CheckpointError(
            [f"{key!r} holds a non-finite value (NaN or infinity) on rank {rank}" for rank, key in found]
            + ["the previous checkpoint, if any, is left as it was"],
            "the save is refused",
            "reason",
        )


def _file_entry(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _publish(staging: Path, target: Path) -> None:
    """Put the complete ``staging`` folder in ``target``'s place. Between the two renames the target
    is absent, never a mix: the old folder is whole beside it until the new one is in place."""
    aside = _aside(target)
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


def verified_or_refused(directory: str | os.PathLike[str], *, allow_unverified: bool = False, no_dist: bool = False) -> bool:
    """``verify_checkpoint``, and a refusal of a checkpoint meshbind wrote whose manifest is gone:
    its files could be damaged or mixed with another save's, and nothing can tell. Loading it
    anyway is the caller's choice (``allow_unverified``)."""
    verified = verify_checkpoint(directory, no_dist=no_dist)
    if not verified and not allow_unverified and MARK in stored_shapes(directory):
        raise CheckpointError(
            [
                f"{os.fspath(directory)!r} was written by meshbind (its .metadata says so), but its {MANIFEST} is gone: "
                "its files cannot be verified; allow_unverified=True (--allow-unverified) loads it anyway"
            ],
            "the checkpoint is refused unverified",
            "reason",
        )
    return verified


def verify_checkpoint(directory: str | os.PathLike[str], *, no_dist: bool = False) -> bool:
    """Whether the manifest in ``directory`` holds: every file it lists there at its size and
        sha256, no other file beside them. ``False`` for a checkpoint without one (written by torchtitan
        or plain ``torch.distributed.checkpoint``: it cannot be verified); a ``CheckpointError`` naming
        every damaged, missing or foreign file otherwise. In a world every rank calls it and hashes its
    share of the files (``no_dist``: one process hashes them all)."""
    path = Path(directory)
    manifest = path / MANIFEST
    if not manifest.is_file():
        return False
    files = _json(manifest).get("files")
    if not isinstance(files, dict):
        raise _damaged([f"{os.fspath(manifest)!r} lists no files: the manifest is damaged"])
    present = sorted(file.name for file in path.iterdir() if file.is_file() and file.name != MANIFEST)
    problems = [f"{name!r}: not in the manifest (left by another save?)" for name in present if name not in files]
    together = _in_world() and not no_dist
    rank, world = (dist.get_rank(), dist.get_world_size()) if together else (0, 1)
    mine = sorted(files)[rank::world]
    found = [problem for name in mine if (problem := _file_problem(path / name, files[name]))]
    problems += [problem for share in (_gathered(found) if together else [found]) for problem in share]
    if problems:
        raise _damaged([f"{os.fspath(directory)!r} is damaged:", *problems])
    return True


def _file_problem(path: Path, entry: Any) -> str | None:
    if not path.is_file():
        return f"{path.name!r}: missing"
    if not isinstance(entry, dict):
        return f"{path.name!r}: the manifest's entry is damaged"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return f"{path.name!r}: {size} bytes, the manifest says {entry.get('bytes')} (truncated or replaced)"
    if _file_entry(path)["sha256"] != entry.get("sha256"):
        return f"{path.name!r}: its sha256 differs from the manifest's (damaged)"
    return None


@dataclass(frozen=True)
class Misfit:
    """One key where a checkpoint and a model disagree."""

    kind: str
    """``missing`` (the model has it, the checkpoint not), ``unexpected`` (the reverse), ``shape``."""
    key: str
    reason: str

    def line(self) -> str:
        return f"{self.key!r}: {self.reason}"


def checkpoint_fit(model: nn.Module, directory: str | os.PathLike[str]) -> list[Misfit]:
    """Every key where the checkpoint in ``directory`` and ``model``'s state dict disagree, from the
    checkpoint's metadata alone: a ``torch.distributed.checkpoint`` directory (``.metadata``) or a
    Hugging Face safetensors directory (``model.safetensors.index.json`` or ``*.safetensors``; each
    file's header only, no tensor data). Shapes are global, so any layout can be checked."""
    stored = stored_shapes(directory)
    stored.pop(MARK, None)
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items() if isinstance(value, torch.Tensor)}
    misfits = []
    for key, shape in expected.items():
        if key not in stored:
            misfits.append(Misfit("missing", key, "not in the checkpoint"))
        elif stored[key] is None:
            misfits.append(Misfit("shape", key, "the checkpoint holds an object, not a tensor"))
        elif stored[key] != shape:
            misfits.append(Misfit("shape", key, f"the checkpoint's shape {stored[key]} is not the model's {shape}"))
    misfits += [Misfit("unexpected", key, "in the checkpoint, not in the model") for key in stored if key not in expected]
    return misfits


class ForbiddenGlobal(pickle.UnpicklingError):
    """A ``.metadata`` pickle that names something no checkpoint metadata holds."""


_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": None,  # every class that module defines
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles ``torch.distributed.checkpoint``'s ``.metadata`` and nothing else: only the classes
    its metadata is made of (DCP's metadata classes, torch sizes, dtypes and layouts, paths) may be
    named, so a crafted file cannot run code the way ``pickle.load`` would let it."""

    def find_class(self, module: str, name: str) -> Any:
        names = _METADATA_GLOBALS.get(module, set())
        if names is None:  # a class defined there, not a name it imports
            found = getattr(sys.modules.get(module), name, None)
            allowed = isinstance(found, type) and found.__module__ == module
        else:
            allowed = name in names or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise ForbiddenGlobal(f"it names {module}.{name}, which no checkpoint metadata holds")
        return super().find_class(module, name)


def stored_shapes(directory: str | os.PathLike[str]) -> dict[str, tuple[int, ...] | None]:
    """Each key a checkpoint directory holds, with its global shape (``None``: not a tensor)."""
    path = Path(directory)
    if (path / ".metadata").is_file():
        try:
            with open(path / ".metadata", "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except ForbiddenGlobal as error:
            raise _damaged(
                [f"{os.fspath(path / '.metadata')!r} is not torch.distributed.checkpoint metadata: {error}; refused unread"]
            ) from None
        except Exception as error:  # a truncated or empty pickle raises EOFError, UnpicklingError, ...
            raise _damaged(
                [
                    f"{os.fspath(path / '.metadata')!r} is unreadable torch.distributed.checkpoint metadata: "
                    f"{type(error).__name__}: {error}"
                ]
            ) from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise _damaged([f"{os.fspath(path / '.metadata')!r} holds a {type(metadata).__name__}, not checkpoint metadata"])
        storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
        referenced = sorted({str(getattr(info, "relative_path", "")) for info in storage.values()})
        missing = [name for name in referenced if not (path / name).is_file()]
        if missing:
            raise _damaged(
                [f"{os.fspath(path / name)!r}: the metadata stores tensors there, but it is missing" for name in missing]
            )
        return {
            key: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
            for key, entry in metadata.state_dict_metadata.items()
        }
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise _damaged([f"{os.fspath(index)!r}: its weight_map is not an object of file names"])
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(file.name for file in path.glob("*.safetensors"))
    aside = _aside(path)
    if not files and not path.exists() and aside.is_dir():
        raise CheckpointError(
            [f"{os.fspath(directory)!r} is missing: a save was stopped while replacing it, and the previous "
             f"checkpoint is whole in {os.fspath(aside)!r} (move it back)"],
            "no checkpoint to read",
            "reason",
        )  # fmt: skip
    if not files:
        raise CheckpointError(
            [f"{os.fspath(directory)!r} is neither a torch.distributed.checkpoint directory (no .metadata) "
             "nor a safetensors one (no model.safetensors.index.json, no *.safetensors)"],
            "no checkpoint to read",
            "reason",
        )  # fmt: skip
    shapes: dict[str, tuple[int, ...] | None] = {}
    for name in files:
        shapes |= _safetensors_header_shapes(path / name)
    return shapes


def _safetensors_header_shapes(file: Path) -> dict[str, tuple[int, ...] | None]:
    """A safetensors file's keys and shapes from its header (an 8-byte little-endian length, then
    that much JSON); the tensors' bytes are never read."""
    try:
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if length <= 0 or length > 100_000_000:
                raise ValueError(f"a header length of {length} bytes")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, RecursionError) as error:
        reason = "nested too deep" if isinstance(error, RecursionError) else str(error)
        raise _damaged([f"{os.fspath(file)!r} is not a readable safetensors file: {reason}"]) from None
    if not isinstance(header, dict):
        raise _damaged([f"{os.fspath(file)!r} is not a readable safetensors file: its header is not a JSON object"])
    shapes: dict[str, tuple[int, ...] | None] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(size, int) and size >= 0 for size in shape):
            raise _damaged([f"{os.fspath(file)!r} is not a readable safetensors file: {key!r} has no shape in its header"])
        shapes[key] = tuple(shape)
    return shapes


def _json(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > _MAX_JSON_BYTES:
            raise ValueError(f"over {_MAX_JSON_BYTES:,} bytes")
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        reason = "nested too deep" if isinstance(error, RecursionError) else str(error)
        raise _damaged([f"{os.fspath(path)!r} is not readable JSON: {reason}"]) from None
    if not isinstance(value, dict):
        raise _damaged([f"{os.fspath(path)!r}: is JSON, but not an object"])
    return value


_MAX_JSON_BYTES = 64 * 2**20
"""The largest manifest or safetensors index read: real ones are kilobytes to a few megabytes."""


def _damaged(problems: list[str]) -> CheckpointError:
    """A file of the checkpoint that cannot be read as what it should be."""
    return CheckpointError(problems, "the checkpoint is damaged", "problem")


def checkpoint_misfits(model: nn.Module, directory: str | os.PathLike[str]) -> list[str]:
    """What keeps the checkpoint in ``directory`` from loading into ``model``: each key the model
    has that the checkpoint lacks or holds at another global shape (keys only the checkpoint has
    are left alone by a load, and are no misfit)."""
    return [misfit.line() for misfit in checkpoint_fit(model, directory) if misfit.kind != "unexpected"]


def load_checkpoint(
    model: nn.Module, directory: str | os.PathLike[str], *, no_dist: bool = False, allow_unverified: bool = False
) -> None:
    """Load the checkpoint into the model's own tensors, whatever layout saved it; every rank of
    the world calls it (``no_dist``: one process reads it alone). Raises ``CheckpointError``
    naming every damaged file or misfit before any tensor changes. A checkpoint another tool wrote
    (no manifest, no meshbind mark) loads with a warning that it could not be verified; one
    meshbind wrote whose manifest is gone is refused unless ``allow_unverified``."""
    if not no_dist:
        check_ranks_agree("load_checkpoint", lambda: [*model_entries(model), ("checkpoint", os.fspath(directory))])
    verified = verified_or_refused(directory, allow_unverified=allow_unverified, no_dist=no_dist)
    misfits = checkpoint_misfits(model, directory)
    if misfits:
        raise CheckpointError(misfits)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _SINGLE_PROCESS)
        load(model.state_dict(), checkpoint_id=directory, no_dist=no_dist)
    if not verified:
        message = f"{os.fspath(directory)!r} has no {MANIFEST}: loaded without verifying its files"
        warnings.warn(message, stacklevel=2)
