"""Checkpoints that reshard (SPEC §8): a model's state saved under one layout with
``torch.distributed.checkpoint`` loads under another, after a check that it fits.

Every rank enters ``save_checkpoint`` and writes its own shards (gathering a DTensor is a
collective, so a save that only rank 0 enters would hang). ``load_checkpoint`` first compares the
checkpoint's metadata with the model's state dict — every key the model has must be there, at
its global shape — and names every misfit at once before any tensor changes.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from meshbind.errors import CheckpointError

__all__ = ["CheckpointError", "checkpoint_misfits", "load_checkpoint", "save_checkpoint"]


_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
"""torch's warning when a checkpoint is read or written by one process, which here is meant."""


def save_checkpoint(model: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Write the model's state (DTensors as their shards) to ``directory``; every rank calls it
    (in a process with no world, that process alone writes it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _SINGLE_PROCESS)
        save(model.state_dict(), checkpoint_id=directory)


def checkpoint_misfits(model: nn.Module, directory: str | os.PathLike[str]) -> list[str]:
    """What keeps the checkpoint in ``directory`` from loading into ``model``: each key the model
    has that the checkpoint lacks or holds at another global shape (keys only the checkpoint has
    are left alone by a load, and are no misfit)."""
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except (OSError, ValueError) as error:
        raise CheckpointError([f"{os.fspath(directory)!r} is not a torch.distributed.checkpoint directory: {error}"]) from error
    stored = metadata.state_dict_metadata
    misfits = []
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            continue
        entry = stored.get(key)
        if entry is None:
            misfits.append(f"{key!r}: not in the checkpoint")
        elif not isinstance(entry, TensorStorageMetadata):
            misfits.append(f"{key!r}: the checkpoint holds an object, not a tensor")
        elif tuple(entry.size) != tuple(value.shape):
            misfits.append(f"{key!r}: the checkpoint's shape {tuple(entry.size)} is not the model's {tuple(value.shape)}")
    return misfits


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
