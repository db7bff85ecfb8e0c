"""The bytes each parameter's optimizer state takes, per optimizer: none; one momentum buffer;
Adam's two moments, in the parameter's dtype; or float32 moments beside a float32 master copy of a
low-precision parameter (mixed-precision training)."""

from __future__ import annotations

import math

import torch

from meshbind.names import Optimizer
from meshbind.report.rows import ParameterRow


def element_size(dtype: str) -> int:
    itemsize: int = getattr(torch, dtype).itemsize
    return itemsize


def optimizer_bytes(row: ParameterRow, optimizer: Optimizer) -> int:
    local = math.prod(row.local_shape)
    if optimizer is Optimizer.NONE:
        return 0
    if optimizer is Optimizer.SGD_MOMENTUM:
        return row.bytes_per_rank
    if optimizer is Optimizer.ADAM:
        return 2 * row.bytes_per_rank
    master = 0 if row.dtype in ("float32", "float64") else local * 4  # a float32 copy of a low-precision parameter
    return master + 2 * local * max(4, element_size(row.dtype))
