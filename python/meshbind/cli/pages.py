"""The pages the command line writes (``--html``): their path checked before any work, and
written after it."""

from __future__ import annotations

import os

from meshbind.cli.arguments import UsageError


def check_writable(path: str, flag: str) -> None:
    """An output path is checked before any work: its folder must exist and be writable."""
    if not path:
        raise UsageError(f"{flag} '': an empty path names no file")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory, not a file to write")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: the directory {folder} is not writable")


def write_page(path: str, page: str) -> None:
    """``page`` written to ``path``; a path that cannot be written is a usage error naming it."""
    try:
        with open(path, "w", encoding="utf-8") as written:
            written.write(page)
    except OSError as error:
        raise UsageError(f"--html {path}: cannot be written ({error.strerror})") from None
