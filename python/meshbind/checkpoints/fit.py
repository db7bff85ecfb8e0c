"""What a checkpoint holds, read without executing it (DCP's ``.metadata`` through a restricted
unpickler, safetensors headers), and whether it fits a model: each key at its global shape."""

from __future__ import annotations

import json
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from meshbind.checkpoints.files import MARK, aside_of, damaged, json_object
from meshbind.errors import CheckpointError


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
            raise damaged(
                [f"{os.fspath(path / '.metadata')!r} is not torch.distributed.checkpoint metadata: {error}; refused unread"]
            ) from None
        except Exception as error:  # a truncated or empty pickle raises EOFError, UnpicklingError, ...
            raise damaged(
                [
                    f"{os.fspath(path / '.metadata')!r} is unreadable torch.distributed.checkpoint metadata: "
                    f"{type(error).__name__}: {error}"
                ]
            ) from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
            raise damaged([f"{os.fspath(path / '.metadata')!r} holds a {type(metadata).__name__}, not checkpoint metadata"])
        storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
        referenced = sorted({str(getattr(info, "relative_path", "")) for info in storage.values()})
        missing = [name for name in referenced if not (path / name).is_file()]
        if missing:
            raise damaged(
                [f"{os.fspath(path / name)!r}: the metadata stores tensors there, but it is missing" for name in missing]
            )
        return {
            key: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
            for key, entry in metadata.state_dict_metadata.items()
        }
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json_object(index).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise damaged([f"{os.fspath(index)!r}: its weight_map is not an object of file names"])
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(file.name for file in path.glob("*.safetensors"))
    aside = aside_of(path)
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
        raise damaged([f"{os.fspath(file)!r} is not a readable safetensors file: {reason}"]) from None
    if not isinstance(header, dict):
        raise damaged([f"{os.fspath(file)!r} is not a readable safetensors file: its header is not a JSON object"])
    shapes: dict[str, tuple[int, ...] | None] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(size, int) and size >= 0 for size in shape):
            raise damaged([f"{os.fspath(file)!r} is not a readable safetensors file: {key!r} has no shape in its header"])
        shapes[key] = tuple(shape)
    return shapes


def checkpoint_misfits(model: nn.Module, directory: str | os.PathLike[str]) -> list[str]:
    """What keeps the checkpoint in ``directory`` from loading into ``model``: each key the model
    has that the checkpoint lacks or holds at another global shape (keys only the checkpoint has
    are left alone by a load, and are no misfit)."""
    return [misfit.line() for misfit in checkpoint_fit(model, directory) if misfit.kind != "unexpected"]
