"""Checkpoints that reshard (SPEC §8): a model's state saved under one layout with
``torch.distributed.checkpoint`` loads under another, after a check that it fits.

Every rank enters ``save_checkpoint`` and writes its own shards (gathering a DTensor is a
collective, so a save that only rank 0 enters would hang). ``load_checkpoint`` first compares the
checkpoint's metadata with the model's state dict — every key the model has must be there, at
its global shape — and names every misfit at once before any tensor changes.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from meshbind.errors import CheckpointError

__all__ = ["CheckpointError", "Misfit", "checkpoint_fit", "checkpoint_misfits", "load_checkpoint", "save_checkpoint"]


_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
"""torch's warning when a checkpoint is read or written by one process, which here is meant."""


def save_checkpoint(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Write the model's state (DTensors as their shards) to ``directory``; every rank calls it
    (in a process with no world, that process alone writes it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _SINGLE_PROCESS)
        save(model.state_dict(), checkpoint_id=directory)


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


def stored_shapes(directory: str | os.PathLike[str]) -> dict[str, tuple[int, ...] | None]:
    """Each key a checkpoint directory holds, with its global shape (``None``: not a tensor)."""
    path = Path(directory)
    if (path / ".metadata").is_file():
        try:
            metadata = FileSystemReader(path).read_metadata()
        except (OSError, ValueError) as error:
            raise CheckpointError(
                [f"{os.fspath(directory)!r}: unreadable torch.distributed.checkpoint metadata: {error}"]
            ) from error
        return {
            key: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
            for key, entry in metadata.state_dict_metadata.items()
        }
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_json(index).get("weight_map", {}).values()))
    else:
        files = sorted(file.name for file in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            [f"{os.fspath(directory)!r} is neither a torch.distributed.checkpoint directory (no .metadata) "
             "nor a safetensors one (no model.safetensors.index.json, no *.safetensors)"]
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
    except (OSError, ValueError) as error:
        raise CheckpointError([f"{os.fspath(file)!r} is not a readable safetensors file: {error}"]) from error
    return {key: tuple(entry["shape"]) for key, entry in header.items() if key != "__metadata__"}


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError([f"{os.fspath(path)!r} is not readable JSON: {error}"]) from error
    if not isinstance(value, dict):
        raise CheckpointError([f"{os.fspath(path)!r}: a safetensors index is a JSON object"])
    return value


def checkpoint_misfits(model: nn.Module, directory: str | os.PathLike[str]) -> list[str]:
    """What keeps the checkpoint in ``directory`` from loading into ``model``: each key the model
    has that the checkpoint lacks or holds at another global shape (keys only the checkpoint has
    are left alone by a load, and are no misfit)."""
    return [misfit.line() for misfit in checkpoint_fit(model, directory) if misfit.kind != "unexpected"]


def load_checkpoint(model: nn.Module, directory: str | os.PathLike[str], *, no_dist: bool = False) -> None:
    """Load the checkpoint into the model's own tensors, whatever layout saved it; every rank of
    the world calls it (``no_dist``: one process reads it alone). Raises ``CheckpointError``
    naming every misfit before any tensor changes."""
    misfits = checkpoint_misfits(model, directory)
    if misfits:
        raise CheckpointError(misfits)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _SINGLE_PROCESS)
        load(model.state_dict(), checkpoint_id=directory, no_dist=no_dist)
