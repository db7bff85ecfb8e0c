"""The FSDP units in the report, per rank: each unit's own shards in its parameters' dtype, the
copy it all-gathers in its ``param_dtype`` while it runs, and its gradients reduce-scattered in its
``reduce_dtype``. torch's rules: no ``param_dtype`` keeps the parameters' own; no
``reduce_dtype`` reduces in ``param_dtype``. Both buffers hold every rank's padded chunk, as
FSDP2 allocates them."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace

import torch

from meshbind.errors import index_groups
from meshbind.report.rows import ParameterRow
from meshbind.resolution.fsdp import FSDPPlan
from meshbind.units import size_text


@dataclass(frozen=True)
class UnitRow:
    """``count`` alike units (``fqn`` written with their layer indices), on every rank of their mesh."""

    fqn: str
    count: int
    mesh: str
    dtype: str
    """Its parameters' own dtype: the shards', the gradients' and the optimizer state's."""
    param_dtype: str
    reduce_dtype: str
    shard_bytes: int
    gathered_bytes: int
    """The all-gathered copy, in ``param_dtype``, while the unit runs."""
    reduce_scatter_bytes: int
    """The unsharded gradients, in ``reduce_dtype``, while they are reduce-scattered."""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def line(self) -> str:
        count = f"{self.count} x " if self.count > 1 else ""
        return (
            f"  {count}{self.fqn} ({self.mesh})  {self.dtype} -> {self.param_dtype}, reduced in {self.reduce_dtype}  "
            f"shards {size_text(self.shard_bytes)}, gathered {size_text(self.gathered_bytes)}, "
            f"reduce-scatter {size_text(self.reduce_scatter_bytes)}"
        )


@dataclass
class _Held:
    """What one unit holds, summed over its own parameters."""

    shard_bytes: int = 0
    gathered: int = 0
    """Elements of every rank's padded chunk."""
    reduced: int = 0
    """The same, of the parameters that take gradients."""
    dtype: str = "-"


def unit_rows(fsdp: FSDPPlan, parameters: Iterable[tuple[str, ParameterRow]]) -> tuple[UnitRow, ...]:
    """One row per group of alike units, in the order ``fully_shard`` takes them."""
    held = {unit.fqn: _Held() for unit in fsdp.units}
    for fqn, row in parameters:
        holding = held[fsdp.unit_of(fqn).fqn]
        unsharded = math.prod(row.local_shape) * row.fsdp_shards
        holding.shard_bytes += row.bytes_per_rank
        holding.gathered += unsharded
        holding.reduced += unsharded if row.requires_grad else 0
        holding.dtype = row.dtype
    rows = []
    for unit in fsdp.units:
        own, policy = held[unit.fqn], unit.policy
        param_dtype = _name(policy.param_dtype) if policy is not None and policy.param_dtype is not None else own.dtype
        reduce_dtype = _name(policy.reduce_dtype) if policy is not None and policy.reduce_dtype is not None else param_dtype
        gathered = own.gathered * _itemsize(param_dtype) if own.gathered else 0
        reduced = own.reduced * _itemsize(reduce_dtype) if own.reduced else 0
        fqn = unit.fqn or "<root>"
        rows.append(UnitRow(fqn, 1, unit.mesh, own.dtype, param_dtype, reduce_dtype, own.shard_bytes, gathered, reduced))
    # Alike: every field but the name and the count (shallow: astuple deep-copies each row).
    alike = index_groups([(row.fqn, tuple(getattr(row, field.name) for field in fields(row)[2:])) for row in rows])
    return tuple(replace(rows[members[0]], fqn=fqn or rows[members[0]].fqn, count=len(members)) for fqn, members in alike)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(name: str) -> int:
    size: int = getattr(torch, name).itemsize
    return size
