"""Loading a checkpoint into a model's own tensors, whatever layout saved it, once it is verified
and fits."""

from __future__ import annotations

import os
import warnings

from torch.distributed.checkpoint.state_dict_loader import load

from meshbind.checkpoints.files import (
    MANIFEST,
    SINGLE_PROCESS,
)
from meshbind.checkpoints.fit import checkpoint_misfits
from meshbind.checkpoints.parts import Models, agree_on, merged_state, parts_of
from meshbind.checkpoints.verify import verified_or_refused
from meshbind.errors import CheckpointError
from meshbind.mesh import MeshContext


def load_checkpoint(
    model: Models,
    directory: str | os.PathLike[str],
    *,
    no_dist: bool = False,
    allow_unverified: bool = False,
    mesh_context: MeshContext | None = None,
) -> None:
    """Load the checkpoint into the model's own tensors, whatever layout saved it; every rank of
    the world calls it (``no_dist``: one process reads it alone). Raises ``CheckpointError``
    naming every damaged file or misfit before any tensor changes. A checkpoint another tool wrote
    (no manifest, no meshbind mark) loads with a warning that it could not be verified; one
    meshbind wrote whose manifest is gone is refused unless ``allow_unverified``. Under a pipeline
    ``model`` is the rank's stage models and ``mesh_context`` its meshes: each loads its modules,
    whatever layout saved them, and a checkpoint lacking one of their keys is refused naming it."""
    parts = parts_of(model)
    if not no_dist:
        agree_on("load_checkpoint", parts, directory, mesh_context)
    verified = verified_or_refused(directory, allow_unverified=allow_unverified, no_dist=no_dist)
    misfits = [misfit for part in parts for misfit in checkpoint_misfits(part, directory)]
    if misfits:
        raise CheckpointError(misfits)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", SINGLE_PROCESS)
        load(merged_state(parts), checkpoint_id=directory, no_dist=no_dist)
    if not verified:
        message = f"{os.fspath(directory)!r} has no {MANIFEST}: loaded without verifying its files"
        warnings.warn(message, stacklevel=2)
