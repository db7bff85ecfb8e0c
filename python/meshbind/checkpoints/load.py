"""Loading a checkpoint into a model's own tensors, whatever layout saved it, once it is verified
and fits."""

from __future__ import annotations

import os
import warnings

from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load

from meshbind.agreement import check_ranks_agree, model_entries
from meshbind.checkpoints.files import (
    MANIFEST,
    SINGLE_PROCESS,
)
from meshbind.checkpoints.fit import checkpoint_misfits
from meshbind.checkpoints.verify import verified_or_refused
from meshbind.errors import CheckpointError


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
        warnings.filterwarnings("ignore", SINGLE_PROCESS)
        load(model.state_dict(), checkpoint_id=directory, no_dist=no_dist)
    if not verified:
        message = f"{os.fspath(directory)!r} has no {MANIFEST}: loaded without verifying its files"
        warnings.warn(message, stacklevel=2)
