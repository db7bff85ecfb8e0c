"""Verifying a checkpoint against its manifest: every file there, at its size and digest, and no
other; one meshbind wrote whose manifest is gone is refused unless the caller allows it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshbind.checkpoints.files import MANIFEST, MARK, damaged, file_entry, gathered, in_world, json_object
from meshbind.checkpoints.fit import stored_shapes
from meshbind.errors import CheckpointError


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
    files = json_object(manifest).get("files")
    if not isinstance(files, dict):
        raise damaged([f"{os.fspath(manifest)!r} lists no files: the manifest is damaged"])
    present = sorted(file.name for file in path.iterdir() if file.is_file() and file.name != MANIFEST)
    problems = [f"{name!r}: not in the manifest (left by another save?)" for name in present if name not in files]
    together = in_world() and not no_dist
    rank, world = (dist.get_rank(), dist.get_world_size()) if together else (0, 1)
    mine = sorted(files)[rank::world]
    found = [problem for name in mine if (problem := _file_problem(path / name, files[name]))]
    problems += [problem for share in (gathered(found) if together else [found]) for problem in share]
    if problems:
        raise damaged([f"{os.fspath(directory)!r} is damaged:", *problems])
    return True


def _file_problem(path: Path, entry: Any) -> str | None:
    if not path.is_file():
        return f"{path.name!r}: missing"
    if not isinstance(entry, dict):
        return f"{path.name!r}: the manifest's entry is damaged"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return f"{path.name!r}: {size} bytes, the manifest says {entry.get('bytes')} (truncated or replaced)"
    if file_entry(path)["sha256"] != entry.get("sha256"):
        return f"{path.name!r}: its sha256 differs from the manifest's (damaged)"
    return None
