"""``plan_report`` builds the report: every parameter's local shape and bytes under a resolved plan, and each rank's
totals, from the model's parameters and the plan's named placements alone."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from torch import nn
from torch.distributed.tensor import Placement

import meshbind._core as _core
from meshbind.model_index import ModelIndex, ParameterKind, index_of
from meshbind.names import Optimizer
from meshbind.pipeline.stages import PipelineStages
from meshbind.placements import fsdp_chunk_shape, local_shape
from meshbind.report.rows import ParameterRow, RankGroup, RankRows, WholeGroup
from meshbind.report.state import element_size, optimizer_bytes
from meshbind.report.units import UnitRow, unit_rows
from meshbind.resolution.plan import ParallelPlan
from meshbind.units import size_text
from meshbind.world import World


@dataclass(frozen=True)
class PlanReport:
    """``plan_report``'s answer: immutable, with ``to_dict()`` and ``text()``."""

    optimizer: Optimizer
    axes: Mapping[str, int]
    world: World
    rank_groups: tuple[RankGroup, ...]
    """Consecutive ranks that hold the same bytes (under a balanced plan, one group: the world)."""
    whole_on_every_rank: tuple[WholeGroup, ...]
    """Ranked by the bytes of each group on every rank, largest first."""
    groups: tuple[tuple[str, tuple[int, ...]], ...]
    """The parameters that differ only in a layer index: ``(written FQN, indices into params)``."""
    entries: tuple[tuple[str, tuple[Any, ...]], ...] = field(repr=False, default=())
    """Each parameter's FQN and its row's other fields, shared by parameters alike."""
    model_totals: Mapping[str, int] = field(repr=False, default_factory=dict)
    """The model's parameter count and bytes in full (``parameters``, ``parameter_bytes_full``)."""
    fsdp_units: str | None = None
    """The plan's FSDP units and who chose them (``FSDPPlan.describe``), ``None`` without FSDP."""
    units: tuple[UnitRow, ...] = ()
    """Each group of alike FSDP units: its shards, gathered copy and reduce-scatter, per rank."""

    def _row(self, index: int) -> ParameterRow:
        fqn, fields = self.entries[index]
        return ParameterRow(fqn, *fields)

    @functools.cached_property
    def params(self) -> tuple[ParameterRow, ...]:
        """One row per parameter of the model, in ``named_parameters()`` order."""
        return tuple(ParameterRow(fqn, *fields) for fqn, fields in self.entries)

    @functools.cached_property
    def ranks(self) -> RankRows:
        """Every rank's row (coordinates and bytes), made when read."""
        return RankRows(self.world, self.rank_groups)

    @property
    def parameter_count(self) -> int:
        return self.model_totals["parameters"]

    def totals(self) -> dict[str, int]:
        """The model's parameter count and bytes, and the largest rank's bytes of each kind."""
        largest = max(self.rank_groups, key=lambda group: group.total_bytes)
        return {
            "parameters": self.model_totals["parameters"],
            "parameter_bytes_full": self.model_totals["parameter_bytes_full"],
            "parameter_bytes_per_rank": largest.parameter_bytes,
            "gradient_bytes_per_rank": largest.gradient_bytes,
            "optimizer_bytes_per_rank": largest.optimizer_bytes,
            "total_bytes_per_rank": largest.total_bytes,
            "world_size": sum(group.count for group in self.rank_groups),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``rank_groups`` (consecutive ranks holding the same bytes), ``params``,
        ``whole_on_every_rank``, ``totals``, and ``groups`` (the parameters shown as one line: a
        written FQN and indices into ``params``)."""
        return {
            "optimizer": self.optimizer,
            "axes": dict(self.axes),
            "fsdp_units": self.fsdp_units,
            "units": [unit.to_dict() for unit in self.units],
            "totals": self.totals(),
            "rank_groups": [
                {
                    "first": g.first,
                    "count": g.count,
                    "first_coordinates": self.ranks.coordinates(g.first),
                    "stages": list(g.stages),
                    "parameter_bytes": g.parameter_bytes,
                    "gradient_bytes": g.gradient_bytes,
                    "optimizer_bytes": g.optimizer_bytes,
                    "total_bytes": g.total_bytes,
                }
                for g in self.rank_groups
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
                    "fsdp_shards": p.fsdp_shards,
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
            placed += f", fsdp/{row.fsdp_shards}" if row.fsdp_shards > 1 else ""
            count = f"{len(members)} x " if len(members) > 1 else ""
            lines.append(
                f"  {count}{fqn}  {list(row.shape)} -> {list(row.local_shape)}  {placed}  {size_text(row.bytes_per_rank)}"
            )
        totals = self.totals()
        kinds = f"parameters {size_text(totals['parameter_bytes_per_rank'])}, gradients " + (
            f"{size_text(totals['gradient_bytes_per_rank'])}, optimizer ({self.optimizer}) "
            f"{size_text(totals['optimizer_bytes_per_rank'])}, total {size_text(totals['total_bytes_per_rank'])}"
        )
        if len(self.rank_groups) == 1:
            lines.append(f"every one of the {self.rank_groups[0].count:,} ranks holds: {kinds}")
        else:
            lines += [
                f"ranks {g.first}-{g.first + g.count - 1} (from {self.ranks.coordinates(g.first)}"
                + (f"; stage{'s' if len(g.stages) > 1 else ''} {', '.join(map(str, g.stages))}" if g.stages else "")
                + f"): {size_text(g.total_bytes)}"
                for g in self.rank_groups
            ]
        if self.whole_on_every_rank:
            lines.append(f"whole on every rank{' of its stage' if self.world.pp > 1 else ''}, largest first:")
            for group in self.whole_on_every_rank[:whole_rows]:
                count = f"{group.count} x " if group.count > 1 else ""
                lines.append(f"  {count}{group.fqn}: {size_text(group.bytes_each)} each rank")
            if len(self.whole_on_every_rank) > whole_rows:
                lines.append(f"  ... and {len(self.whole_on_every_rank) - whole_rows} more groups")
        lines.append(
            f"{totals['parameters']:,} parameters, {size_text(totals['parameter_bytes_full'])} in full; "
            f"layout {', '.join(f'{a}={s}' for a, s in self.axes.items()) or '(no axes)'}"
        )
        if self.fsdp_units is not None:
            lines.append(self.fsdp_units)
            lines.append("FSDP units per rank (own dtype -> gathered in, reduced in; shards, gathered copy, reduce-scatter):")
            lines += [unit.line() for unit in self.units]
        if self.optimizer is Optimizer.ADAM_FP32_MASTER and any(unit.param_dtype != unit.dtype for unit in self.units):
            lines.append(
                "optimizer adam-fp32-master: under FSDP2 mixed precision the float32 shards are the master copy, "
                "so no second copy is counted (it is adam on the shards)"
            )
        return "\n".join(lines)


def plan_report(
    model: nn.Module | ModelIndex,
    plan: ParallelPlan,
    *,
    optimizer: str = Optimizer.ADAM,
    pipeline: PipelineStages | None = None,
) -> PlanReport:
    """What each rank holds under ``plan``: every parameter's local shape and bytes, each rank's
    parameter, gradient and optimizer-state bytes, and what stays whole on every rank. ``model``
    is the model, or its index; the plan's own index (``resolve_plan(..., index=True)``) is read
    when it is this model's, else the model is walked. Under a pipeline (``pp`` above 1)
    ``pipeline`` is its split (``split_stages``): each pipeline rank's ranks hold the parameters
    of the stages it runs, and are a group of their own."""
    chosen = Optimizer.parse(optimizer, "optimizer")
    if not isinstance(model, (nn.Module, ModelIndex)):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a ParallelPlan (resolve_plan's result), got {type(plan).__name__}")
    _check_pipeline(plan, pipeline)
    axes = plan.context.axis_sizes
    index = model if isinstance(model, ModelIndex) else index_of(model, plan.index)
    fqns, kinds, samples = index.parameter_fqns, index.parameter_kinds, index.kinds
    placings, placed = _placings(plan)
    # One computation per (kind, placing): a model's layers are mostly alike.
    fsdp, world = plan.fsdp, plan.context.world
    shards = [1] * len(fqns) if fsdp is None else [world.fsdp_shard_of(fsdp.unit_of(fqn).mesh) for fqn in fqns]
    keys = [(kind, placed.get(fqn, 0), n) for fqn, kind, n in zip(fqns, kinds, shards, strict=True)]
    counts = Counter(keys)
    computed = {key: _fields(samples[key[0]], *placings[key[1]], axes, key[2]) for key in counts}
    entries = tuple(zip(fqns, map(computed.__getitem__, keys), strict=True))
    row_of = {key: ParameterRow("", *fields) for key, fields in computed.items()}
    rows = [(row_of[key], count) for key, count in counts.items()]
    if pipeline is None:
        rank_groups: tuple[RankGroup, ...] = (RankGroup(*_state_bytes(rows, chosen), first=0, count=world.size),)
    else:
        rank_groups = _stage_groups(pipeline, world, fqns, keys, row_of, chosen)
    # Rows shown as one line share shape, dtype, placements and requires_grad (not the protocol).
    codes: dict[tuple[Any, ...], int] = {}
    code_of = {
        key: codes.setdefault(
            (row.shape, row.dtype, tuple(row.placements.items()), row.requires_grad, row.fsdp_shards), len(codes)
        )
        for key, row in row_of.items()
    }
    groups = tuple((fqn, tuple(members)) for fqn, members in _core.index_groups(fqns, list(map(code_of.__getitem__, keys))))
    whole = sorted(
        (WholeGroup(fqn, len(members), row.bytes_per_rank) for fqn, members in groups if (row := row_of[keys[members[0]]]).whole),
        key=lambda group: -group.bytes_each * group.count,
    )
    model_totals = {
        "parameters": sum(math.prod(row.shape) * count for row, count in rows),
        "parameter_bytes_full": sum(math.prod(row.shape) * element_size(row.dtype) * count for row, count in rows),
    }
    return PlanReport(
        chosen,
        MappingProxyType(dict(axes)),
        plan.context.world,
        rank_groups,
        tuple(whole),
        groups,
        entries,
        MappingProxyType(model_totals),
        None if fsdp is None else fsdp.describe(),
        () if fsdp is None else unit_rows(fsdp, zip(fqns, (row_of[key] for key in keys), strict=True)),
    )


def _check_pipeline(plan: ParallelPlan, pipeline: PipelineStages | None) -> None:
    pp = plan.context.world.pp
    if pipeline is None and pp > 1:
        raise ValueError(
            f"the plan has pp={pp}: give plan_report the pipeline's stages (pipeline=split_stages(index, {pp}, Pipeline(...)))"
        )
    if pipeline is not None and pipeline.pp != pp:
        raise ValueError(f"the pipeline's stages are split over pp={pipeline.pp}, but the plan has pp={pp}")


def _state_bytes(rows: Iterable[tuple[ParameterRow, int]], optimizer: Optimizer) -> tuple[int, int, int]:
    """The parameter, gradient and optimizer-state bytes of ``rows`` (each row and how many)."""
    parameter = gradient = state = 0
    for row, count in rows:
        parameter += row.bytes_per_rank * count
        if row.requires_grad:
            gradient += row.bytes_per_rank * count
            state += optimizer_bytes(row, optimizer) * count
    return parameter, gradient, state


_Key = tuple[int, int, int]
"""A parameter's kind, placing and FSDP shards: parameters of one key have one row."""


def _stage_groups(
    pipeline: PipelineStages,
    world: World,
    fqns: Sequence[str],
    keys: Sequence[_Key],
    row_of: Mapping[_Key, ParameterRow],
    optimizer: Optimizer,
) -> tuple[RankGroup, ...]:
    """One group per pipeline rank: its ranks hold the parameters of the stages it runs (each
    parameter's stage found by walking up its FQN to a stage's module)."""
    stage_of_root = {root: stage for stage, modules in enumerate(pipeline.stages) for root in modules}
    per_stage: list[Counter[_Key]] = [Counter() for _ in pipeline.stages]
    for fqn, key in zip(fqns, keys, strict=True):
        holder = fqn
        while holder and holder not in stage_of_root:
            holder = holder.rpartition(".")[0]
        if holder in stage_of_root:
            per_stage[stage_of_root[holder]][key] += 1
    groups = []
    for pp_rank in range(pipeline.pp):
        stages = pipeline.stages_of_rank(pp_rank)
        held: Counter[_Key] = Counter()
        for stage in stages:
            held.update(per_stage[stage])
        state = _state_bytes(((row_of[key], count) for key, count in held.items()), optimizer)
        groups.append(RankGroup(*state, first=pp_rank * world.stage_size, count=world.stage_size, stages=stages))
    return tuple(groups)


def _placings(plan: ParallelPlan) -> tuple[list[tuple[Mapping[str, Placement], str | None]], dict[str, int]]:
    """The plan's distinct ``(named placements, protocol)`` (the first: unplanned, whole) and the
    index of each planned parameter's. Providers hand alike modules one spec, read once."""
    placings: list[tuple[Mapping[str, Placement], str | None]] = [(_NOTHING, None)]
    index_of: dict[tuple[int, str], int] = {}
    paths_of: dict[tuple[int, str], list[tuple[str, int]]] = {}
    placed = {}
    parallel = plan.parallel_modules
    for fqn, sharding in plan.sharding.items():
        protocol = parallel[fqn].protocol
        paths = paths_of.get((id(sharding), protocol))
        if paths is None:
            paths = paths_of[id(sharding), protocol] = []
            for path, named in sharding.params.items():
                index = index_of.setdefault((id(named), protocol), len(placings))
                if index == len(placings):
                    placings.append((named, protocol))
                paths.append((path, index))
        prefix = f"{fqn}." if fqn else ""
        for path, index in paths:
            placed[prefix + path] = index
    return placings, placed


def _fields(
    kind: ParameterKind, named: Mapping[str, Placement], protocol: str | None, axes: Mapping[str, int], fsdp_shards: int
) -> tuple[Any, ...]:
    """A row's fields but its FQN, for every parameter of ``kind`` placed by ``named``, and split
    by FSDP over ``fsdp_shards`` ranks."""
    local = fsdp_chunk_shape(local_shape(kind.shape, named, axes), fsdp_shards)
    placements = MappingProxyType({axis: str(p) for axis, p in named.items()})
    size = math.prod(local) * kind.dtype.itemsize
    return kind.shape, kind.dtype_name, placements, local, size, kind.requires_grad, protocol, fsdp_shards


_NOTHING: Mapping[str, Placement] = MappingProxyType({})
