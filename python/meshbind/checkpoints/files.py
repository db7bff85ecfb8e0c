"""What every part of a checkpoint's handling shares: the names of meshbind's own files and
mark, JSON read within limits, the error for a damaged file, and a value gathered from the ranks."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshbind.errors import CheckpointError

SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
"""torch's warning when a checkpoint is read or written by one process, which here is meant."""
MANIFEST = "meshbind-manifest.json"
"""Each file of a checkpoint with its size and sha256, written last, by rank 0."""
MARK = "meshbind-checkpoint"
"""The key a meshbind save adds to the state it writes: its ``.metadata`` then says who wrote it,
so a checkpoint whose manifest is gone is known for what it is."""
CHUNK = 1 << 22


def in_world() -> bool:
    return dist.is_available() and dist.is_initialized()


def gathered(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (one process: itself)."""
    if not in_world():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def json_object(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ValueError(f"over {MAX_JSON_BYTES:,} bytes")
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        reason = "nested too deep" if isinstance(error, RecursionError) else str(error)
        raise damaged([f"{os.fspath(path)!r} is not readable JSON: {reason}"]) from None
    if not isinstance(value, dict):
        raise damaged([f"{os.fspath(path)!r}: is JSON, but not an object"])
    return value


MAX_JSON_BYTES = 64 * 2**20
"""The largest manifest or safetensors index read: real ones are kilobytes to a few megabytes."""


def damaged(problems: list[str]) -> CheckpointError:
    """A file of the checkpoint that cannot be read as what it should be."""
    return CheckpointError(problems, "the checkpoint is damaged", "problem")


def staging_of(target: Path) -> Path:
    return target.parent / f".{target.name}.saving"


def aside_of(target: Path) -> Path:
    return target.parent / f".{target.name}.replaced"


def file_entry(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
