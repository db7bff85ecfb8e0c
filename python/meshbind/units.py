"""Sizes: the largest one the Rust side takes, and bytes written and read as people write them."""

from __future__ import annotations

import math

INT64_MAX = 2**63 - 1
"""The largest axis size, expert count or parameter size: what Rust's arithmetic takes."""


def is_int_from(value: object, low: int) -> bool:
    """Whether ``value`` is an int (a bool is not) from ``low`` to ``INT64_MAX``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= INT64_MAX


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_READ = {"tib": 2**40, "tb": 2**40, "gib": 2**30, "gb": 2**30, "mib": 2**20, "mb": 2**20, "kib": 2**10, "kb": 2**10, "b": 1}


def size_text(count: int) -> str:
    """``512 B``, ``1.50 KiB``, ``27.22 GiB``: the largest unit that keeps the number below 1024."""
    value = float(count)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{count} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``512MiB``, ``1e9``: a number of bytes (GiB and GB both read as 2**30,
    as GPU makers' "80GB" devices hold 80 GiB)."""
    lowered = text.strip().lower()
    unit = next((unit for unit in _READ if lowered.endswith(unit)), "b")
    number, scale = lowered.removesuffix(unit).strip(), _READ[unit]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"device memory must be a size like 80GiB or 512MiB, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"device memory must be a positive, finite size, got {text!r}")
    return int(value * scale)
