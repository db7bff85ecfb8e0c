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

from meshbind.checkpoints.files import MANIFEST, MARK
from meshbind.checkpoints.fit import Misfit, checkpoint_fit, checkpoint_misfits, stored_shapes
from meshbind.checkpoints.load import load_checkpoint
from meshbind.checkpoints.save import save_checkpoint, save_target_problem
from meshbind.checkpoints.verify import verified_or_refused, verify_checkpoint
from meshbind.errors import CheckpointError

__all__ = [
    "MANIFEST",
    "MARK",
    "CheckpointError",
    "Misfit",
    "checkpoint_fit",
    "checkpoint_misfits",
    "load_checkpoint",
    "save_checkpoint",
    "save_target_problem",
    "stored_shapes",
    "verified_or_refused",
    "verify_checkpoint",
]
