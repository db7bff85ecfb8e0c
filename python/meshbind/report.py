"""What each rank will hold under a resolved plan, before any weight exists (``plan_report``).

Everything comes from the model's parameters (on ``meta`` or anywhere) and the plan's named
placements; no process group is needed. Resolution refuses uneven shards (SPEC §9, balanced
layouts), so a parameter's local shape is the same on every rank: each dimension divided by the
product of the sizes of the axes that shard it. Every rank of the world therefore holds the same
bytes; the report still lists each rank by its coordinates, which is what a launch script names.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import product
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshbind._core import PatternSet
from meshbind.errors import index_groups
from meshbind.resolution.plan import ParallelPlan

OPTIMIZERS = ("none", "sgd-momentum", "adam", "adam-fp32-master")
"""The optimizers whose state the report counts, per parameter that requires grad: none; one
momentum buffer; Adam's two moments, in the parameter's dtype; or float32 moments beside a float32
master copy of a low-precision parameter (mixed-precision training)."""

EXPERT_AXES = ("ep", "edp_replicate", "edp_shard")
"""Axes laid over the same ranks as the device mesh's (SPEC §6): they add no ranks to the world."""


class ParameterRow(NamedTuple):
    """One parameter of the model, planned or not (unplanned: whole on every rank). A named tuple:
    a report holds one per parameter of the model."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    placements: Mapping[str, str]
    """Axis → placement as torch writes it (``S(0)``, ``R``); empty when no plan entry places it."""
    local_shape: tuple[int, ...]
    bytes_per_rank: int
    requires_grad: bool
    protocol: str | None
    """The protocol of the planned module it belongs to (``None``: not planned)."""

    @property
    def whole(self) -> bool:
        """Whether every rank holds all of it."""
        return self.local_shape == self.shape


@dataclass(frozen=True)
class RankRow:
    """What one rank holds, by its coordinates on the axes."""

    rank: int
    coordinates: Mapping[str, int]
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class WholeGroup:
    """Parameters that stay whole on every rank and differ only in a layer index."""

    fqn: str
    """``model.layers.<0-47>.mlp.experts.gate_up_proj`` (one FQN when alone)."""
    count: int
    bytes_each: int
    """Each one's bytes on every rank."""


@dataclass(frozen=True)
class PlanReport:
    """``plan_report``'s answer: immutable, with ``to_dict()`` and ``text()``."""

    optimizer: str
    axes: Mapping[str, int]
    ranks: tuple[RankRow, ...]
    whole_on_every_rank: tuple[WholeGroup, ...]
    """Ranked by the bytes of each group on every rank, largest first."""
    groups: tuple[tuple[str, tuple[int, ...]], ...]
    """The parameters that differ only in a layer index: ``(written FQN, indices into params)``."""
    entries: tuple[tuple[str, tuple[Any, ...]], ...] = field(repr=False, default=())
    """Each parameter's FQN and its row's other fields, shared by parameters alike."""

    def _row(self, index: int) -> ParameterRow:
        fqn, fields = self.entries[index]
        return ParameterRow(fqn, *fields)

    @functools.cached_property
    def params(self) -> tuple[ParameterRow, ...]:
        """One row per parameter of the model, in ``named_parameters()`` order."""
        return tuple(ParameterRow(fqn, *fields) for fqn, fields in self.entries)

    @property
    def parameter_count(self) -> int:
        return sum(math.prod(fields[0]) for _, fields in self.entries)

    def totals(self) -> dict[str, int]:
        """The model's parameter count and bytes, and the largest rank's bytes of each kind."""
        return dict(self._totals)

    @functools.cached_property
    def _totals(self) -> dict[str, int]:
        largest = max(self.ranks, key=lambda rank: rank.total_bytes)
        return {
            "parameters": self.parameter_count,
            "parameter_bytes_full": sum(math.prod(fields[0]) * _element_size(fields[1]) for _, fields in self.entries),
            "parameter_bytes_per_rank": largest.parameter_bytes,
            "gradient_bytes_per_rank": largest.gradient_bytes,
            "optimizer_bytes_per_rank": largest.optimizer_bytes,
            "total_bytes_per_rank": largest.total_bytes,
            "world_size": len(self.ranks),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``ranks``, ``params``, ``whole_on_every_rank``, ``totals``, and ``groups`` (the
        parameters shown as one line: a written FQN and indices into ``params``)."""
        return {
            "optimizer": self.optimizer,
            "axes": dict(self.axes),
            "totals": self.totals(),
            "ranks": [
                {
                    "rank": r.rank,
                    "coordinates": dict(r.coordinates),
                    "parameter_bytes": r.parameter_bytes,
                    "gradient_bytes": r.gradient_bytes,
                    "optimizer_bytes": r.optimizer_bytes,
                    "total_bytes": r.total_bytes,
                }
                for r in self.ranks
            ],
            "params": [
                {
                    "fqn": p.fqn,
                    "shape": list(p.shape),
                    "dtype": p.dtype,
                    "placements": dict(p.placements),
                    "local_shape": list(p.local_shape),
                    "bytes_per_rank": p.bytes_per_rank,
                    "requires_grad": p.requires_grad,
                    "protocol": p.protocol,
                }
                for p in self.params
            ],
            "whole_on_every_rank": [
                {"fqn": g.fqn, "count": g.count, "bytes_each": g.bytes_each} for g in self.whole_on_every_rank
            ],
            "groups": [{"fqn": fqn, "members": list(members)} for fqn, members in self.groups],
        }

    def text(self, *, whole_rows: int = 10) -> str:
        """The report as ``meshbind check --report`` prints it: parameters grouped by layer index,
        the ranks (one line when they all hold the same), and the largest parameters left whole."""
        lines = ["parameters (shape -> local shape per rank, placements, bytes per rank):"]
        for fqn, members in self.groups:
            row = self._row(members[0])
            placed = ", ".join(f"{axis}:{p}" for axis, p in row.placements.items()) or "whole"
            count = f"{len(members)} x " if len(members) > 1 else ""
            lines.append(
                f"  {count}{fqn}  {list(row.shape)} -> {list(row.local_shape)}  {placed}  {size_text(row.bytes_per_rank)}"
            )
        totals = self.totals()
        kinds = f"parameters {size_text(totals['parameter_bytes_per_rank'])}, gradients " + (
            f"{size_text(totals['gradient_bytes_per_rank'])}, optimizer ({self.optimizer}) "
            f"{size_text(totals['optimizer_bytes_per_rank'])}, total {size_text(totals['total_bytes_per_rank'])}"
        )
        if len({(r.parameter_bytes, r.gradient_bytes, r.optimizer_bytes) for r in self.ranks}) == 1:
            lines.append(f"every one of the {len(self.ranks)} ranks holds: {kinds}")
        else:
            lines += [f"rank {r.rank} {dict(r.coordinates)}: {size_text(r.total_bytes)}" for r in self.ranks]
        if self.whole_on_every_rank:
            lines.append("whole on every rank, largest first:")
            for group in self.whole_on_every_rank[:whole_rows]:
                count = f"{group.count} x " if group.count > 1 else ""
                lines.append(f"  {count}{group.fqn}: {size_text(group.bytes_each)} each rank")
            if len(self.whole_on_every_rank) > whole_rows:
                lines.append(f"  ... and {len(self.whole_on_every_rank) - whole_rows} more groups")
        lines.append(
            f"{totals['parameters']:,} parameters, {size_text(totals['parameter_bytes_full'])} in full; "
            f"layout {', '.join(f'{a}={s}' for a, s in self.axes.items()) or '(no axes)'}"
        )
        return "\n".join(lines)


def plan_report(model: nn.Module, plan: ParallelPlan, *, optimizer: str = "adam") -> PlanReport:
    """What each rank holds under ``plan``: every parameter's local shape and bytes, each rank's
    parameter, gradient and optimizer-state bytes, and what stays whole on every rank."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a ParallelPlan (resolve_plan's result), got {type(plan).__name__}")
    axes = plan.context.axis_sizes
    placed = _placements_by_parameter(plan)
    rows = _Rows(axes)
    entries = tuple((fqn, rows.fields(parameter, placed.get(fqn))) for fqn, parameter in _parameters(model))
    alike = Counter(map(id, (fields for _, fields in entries)))
    distinct = {id(fields): ParameterRow("", *fields) for _, fields in entries}
    parameter_bytes = sum(distinct[key].bytes_per_rank * count for key, count in alike.items())
    learnt = [(distinct[key], count) for key, count in alike.items() if distinct[key].requires_grad]
    gradient = sum(row.bytes_per_rank * count for row, count in learnt)
    state = sum(_optimizer_bytes(row, optimizer) * count for row, count in learnt)
    ranks = tuple(
        RankRow(rank, MappingProxyType(coordinates), parameter_bytes, gradient, state)
        for rank, coordinates in enumerate(_rank_coordinates(axes))
    )
    groups = tuple(
        (str(fqn), tuple(members))
        for fqn, members in index_groups(list(zip([fqn for fqn, _ in entries], rows.kinds, strict=True)))
    )
    representatives = [distinct[id(entries[members[0]][1])] for _, members in groups]
    whole = sorted(
        (
            WholeGroup(fqn, len(members), row.bytes_per_rank)
            for (fqn, members), row in zip(groups, representatives, strict=True)
            if row.whole
        ),
        key=lambda group: -group.bytes_each * group.count,
    )
    return PlanReport(optimizer, MappingProxyType(dict(axes)), ranks, tuple(whole), groups, entries)


def _parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``named_parameters()``: each parameter once, under its first FQN; the modules come from
    one Rust walk, each under its first FQN in ``named_modules()`` order."""
    tree = PatternSet([]).walk(model, prune=False)
    indices = range(tree.module_count)
    seen: set[int] = set()
    found: list[tuple[str, torch.Tensor]] = []
    modules: list[nn.Module] = tree.modules(indices)  # type: ignore[assignment]
    for prefix, module in zip(tree.module_fqns(indices), modules, strict=True):
        for name, parameter in module._parameters.items():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                found.append((f"{prefix}.{name}" if prefix else name, parameter))
    return found


def _placements_by_parameter(plan: ParallelPlan) -> dict[str, tuple[Mapping[str, Placement], str]]:
    placed = {}
    for fqn, sharding in plan.sharding.items():
        protocol = plan.parallel_modules[fqn].protocol
        for path, named in sharding.params.items():
            placed[f"{fqn}.{path}" if fqn else path] = (named, protocol)
    return placed


class _Rows:
    """Builds the rows; parameters alike (shape, dtype, placements) share one computation, which
    the layers of a model mostly are."""

    def __init__(self, axes: Mapping[str, int]) -> None:
        self.axes = axes
        self.computed: dict[tuple[Any, ...], tuple[tuple[Any, ...], tuple[Any, ...]]] = {}
        """Each computation's fields and its kind: what rows shown as one group must share
        (shape, dtype, placements, ``requires_grad``)."""
        self.kinds: list[tuple[Any, ...]] = []
        """The kind of every row made, in order."""

    def fields(self, parameter: torch.Tensor, placed: tuple[Mapping[str, Placement], str] | None) -> tuple[Any, ...]:
        """A row's fields but its FQN; the same object for parameters alike."""
        named, protocol = placed if placed is not None else (_NOTHING, None)
        key = (parameter.shape, parameter.dtype, id(named), protocol, parameter.requires_grad)
        computed = self.computed.get(key)
        if computed is None:
            fields = self._fields(parameter, named, protocol)
            computed = self.computed[key] = (fields, (fields[0], fields[1], tuple(fields[2].items()), fields[5]))
        self.kinds.append(computed[1])
        return computed[0]

    def _fields(self, parameter: torch.Tensor, named: Mapping[str, Placement], protocol: str | None) -> tuple[Any, ...]:
        shape = tuple(parameter.shape)
        local = list(shape)
        for axis, placement in named.items():
            if isinstance(placement, (Shard, _StridedShard)) and 0 <= placement.dim < len(local):
                local[placement.dim] //= self.axes.get(axis, 1)
        local_shape = tuple(local)
        placements = MappingProxyType({axis: str(p) for axis, p in named.items()})
        dtype = str(parameter.dtype).removeprefix("torch.")
        size = math.prod(local_shape) * parameter.element_size()
        return shape, dtype, placements, local_shape, size, parameter.requires_grad, protocol


_NOTHING: Mapping[str, Placement] = MappingProxyType({})


@functools.cache
def _element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype), device="meta").element_size()


def _optimizer_bytes(row: ParameterRow, optimizer: str) -> int:
    local = math.prod(row.local_shape)
    if optimizer == "none":
        return 0
    if optimizer == "sgd-momentum":
        return row.bytes_per_rank
    if optimizer == "adam":
        return 2 * row.bytes_per_rank
    master = 0 if row.dtype in ("float32", "float64") else local * 4  # a float32 copy of a low-precision parameter
    return master + 2 * local * max(4, _element_size(row.dtype))


def _rank_coordinates(axes: Mapping[str, int]) -> list[dict[str, int]]:
    """Each rank's coordinates: the world is the product of the axes besides the expert ones, in
    their order (the last varies fastest); an expert axis is laid over the same ranks, innermost."""
    world_axes = [axis for axis in axes if axis not in EXPERT_AXES]
    coordinates = []
    for rank, position in enumerate(product(*(range(axes[axis]) for axis in world_axes))):
        entry = dict(zip(world_axes, position, strict=True))
        if "ep" in axes:
            entry["ep"] = rank % axes["ep"]
        coordinates.append(entry)
    return coordinates


def size_text(count: int) -> str:
    """Bytes as people read them: ``512 B``, ``1.5 KiB``, ``1.2 GiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
