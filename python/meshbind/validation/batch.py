"""The bulk pass of the ``layout`` checks and the per-module rules: many planned modules checked together.

``ValidationBatch`` groups the modules by their (spec, sharding, class) objects in one Rust call,
runs the class-level rules once per (class, spec) and the sharding rules once per sharding
object, hands the placement arithmetic of every module to Rust in one
``PlacementTable``, and runs each spec's own ``validate`` last. Modules whose placement checks
must give the same answer (one sharding object, one ``num_experts``, the same rank and
``shape[0]`` of every ``Shard`` parameter) are one unit of that table, and its problems are each
module's: a plan of 188k modules sharing a few layouts hands Rust a few rows.

Per module the §5 rules run in order and the first failure is the module's problem; ``layout``
problems (an axis the context lacks, ``Shard(d)`` beyond a parameter's rank, a parameter the module
lacks) are reported beside it, every one of them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

from torch import nn
from torch.distributed.tensor import Partial, Placement, Replicate

import meshbind._core as _core
from meshbind.errors import ProblemCode, did_you_mean
from meshbind.names import PlacementKind
from meshbind.placements import shard_dim
from meshbind.specs import LayoutContext, ModuleShardingSpec, ParallelModuleSpec
from meshbind.units import is_int_from
from meshbind.validation.rules import RAISE_TO_REJECT, ClassFailures, Failure, sharding_failure
from meshbind.world import EXPERT_AXIS, other_spellings

_SHARD, _REPLICATE, _PARTIAL = PlacementKind.SHARD, PlacementKind.REPLICATE, PlacementKind.PARTIAL
_PARAMETERS = attrgetter("_parameters")
_SHAPE = attrgetter("shape")


def _placement_kind(placement: Placement) -> tuple[PlacementKind, int] | None:
    # A strided shard (transformers' packed projections) is checked as a shard of its dimension.
    if (dim := shard_dim(placement)) is not None:
        return _SHARD, dim
    if isinstance(placement, Replicate):
        return _REPLICATE, 0
    if isinstance(placement, Partial):
        return _PARTIAL, 0
    return None


@dataclass(frozen=True)
class _ShardingTemplate:
    """A sharding flattened once: its §5 failure, and its rows without the module's shapes."""

    failure: Failure | None
    rows: tuple[tuple[int, int, PlacementKind, int, str | None], ...]
    """``(label, axis, kind, dim, parameter path or None)``."""
    parameters: tuple[tuple[str, bool], ...]
    """Each parameter path it places, and whether some placement of it is ``Shard`` (needs its shape)."""
    problems: tuple[str, ...]


@dataclass(frozen=True)
class _Unit:
    """Modules whose placement checks have the same answer: one sharding, one ``num_experts`` and
    the same rank and ``shape[0]`` for every ``Shard`` parameter. Rust checks each unit once."""

    template: _ShardingTemplate
    num_experts: int | None
    shapes: Mapping[str, tuple[int, ...] | None]
    """The shape of each ``Shard`` parameter (``None``: not known)."""
    rows: list[int]


class ValidationBatch:
    """Checks many planned modules together (see the module docstring)."""

    def __init__(self, context: LayoutContext, param_shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        self.context = context
        self.param_shapes = param_shapes
        self._table = _core.PlacementTable([], EXPERT_AXIS)
        self._spelled: dict[str, str] = {}

    def check(
        self,
        modules: Sequence[nn.Module | None],
        fqns: Sequence[str],
        specs: Sequence[ParallelModuleSpec],
        shardings: Sequence[ModuleShardingSpec],
        classes: Sequence[type] | None = None,
        *,
        rules_1_to_4_passed: bool = False,
    ) -> list[tuple[int, ProblemCode, str]]:
        """Every problem as ``(index, code, message)``: each module's ``layout`` problems, then its
        first §5 failure (``validate`` runs last, only for modules with no other problem).

        Modules are ``None`` offline: the class rules and ``validate`` then do not run. ``classes``
        (each module's class, when the caller knows them) spares reading every module's type.
        ``rules_1_to_4_passed``: the caller checked rules 1-4 already, which are then not run again.
        """
        # Every axis of the context is in the table, so messages can list them and rule 5 finds 'ep'.
        self._table = _core.PlacementTable(list(self.context.axis_sizes.items()), EXPERT_AXIS)
        # A placement may name an axis by its other name ('dp' for 'dp_replicate'): the context's spelling.
        self._spelled = other_spellings(self.context.axis_sizes)
        failures: dict[int, Failure] = {}
        layout: dict[int, list[str]] = {}
        online = bool(modules) and modules[0] is not None
        row_classes = (list(map(type, modules)) if classes is None else classes) if online else []
        keys: list[list[Any]] = [list(specs), list(shardings), list(row_classes)] if online else [list(specs), list(shardings)]
        templates: dict[int, _ShardingTemplate] = {}
        class_failures = ClassFailures()
        units: list[_Unit] = []
        validated: list[int] = []
        for rows in _core.same_object_groups(keys):
            first = rows[0]
            spec, sharding = specs[first], shardings[first]
            template = templates.get(id(sharding))
            if template is None:
                template = templates[id(sharding)] = self._flatten(sharding)
            failure = None  # the group's first failure: rules 1-2, then the expert count, then 3-4
            if online and not rules_1_to_4_passed:
                failure = class_failures(row_classes[first], spec)
            experts = _expert_count(spec)
            if isinstance(experts, tuple):
                failure, experts = failure or experts, None
            if not rules_1_to_4_passed:
                failure = failure or template.failure
            if failure is not None:
                failures.update(zip(rows, repeat(failure)))
            if template.problems:
                for row in rows:
                    layout.setdefault(row, []).extend(template.problems)
            units += self._units(template, experts, rows, modules, fqns, layout)
            if spec.validate is not None and online:
                validated += rows
        self._fill_table(units)
        for problem in self._table.check():
            for row in units[problem.unit].rows:
                if problem.code is ProblemCode.LAYOUT:
                    layout.setdefault(row, []).append(problem.message)
                else:
                    failures.setdefault(row, (problem.code, problem.message))
        for row in sorted(validated):
            if row not in failures and row not in layout:
                self._run_validator(row, modules, specs, shardings, failures)
        problems = [(row, ProblemCode.LAYOUT, message) for row, messages in sorted(layout.items()) for message in messages]
        problems += [(row, failure[0], failure[1]) for row, failure in sorted(failures.items())]
        return problems

    def _units(
        self,
        template: _ShardingTemplate,
        num_experts: int | None,
        rows: list[int],
        modules: Sequence[nn.Module | None],
        fqns: Sequence[str],
        layout: dict[int, list[str]],
    ) -> list[_Unit]:
        """Split the modules of one group by the shapes of their ``Shard`` parameters, reporting
        every parameter a module lacks."""
        sharded: list[tuple[str, list[tuple[int, ...] | None]]] = []
        for path, need_shape in template.parameters:
            shapes = self._parameter_shapes(rows, modules, fqns, path, need_shape=need_shape)
            if any(map(is_, shapes, repeat(None))) and (modules[rows[0]] is not None or self.param_shapes is not None):
                for row, shape in zip(rows, shapes, strict=True):
                    if shape is None:
                        layout.setdefault(row, []).append(self._missing(modules[row], fqns[row], path))
            if need_shape:
                sharded.append((path, shapes))
        if not sharded:
            return [_Unit(template, num_experts, {}, rows)]
        paths = [path for path, _ in sharded]
        by_shapes: dict[tuple[tuple[int, ...] | None, ...], list[int]] = {}
        for row, row_shapes in zip(rows, zip(*(column for _, column in sharded), strict=True), strict=True):
            by_shapes.setdefault(row_shapes, []).append(row)
        return [_Unit(template, num_experts, dict(zip(paths, key, strict=True)), members) for key, members in by_shapes.items()]

    def _fill_table(self, units: list[_Unit]) -> None:
        """One unit of the table per unit, one row per placement of its sharding."""
        table = self._table
        for unit in units:
            unit_id = table.unit(unit.num_experts)
            for label, axis, kind, dim, path in unit.template.rows:
                shape = unit.shapes.get(path) if kind == _SHARD and path is not None else None
                if shape is None:
                    table.row(unit_id, label, axis, kind, dim)
                    continue
                sharded = dim + len(shape) if dim < 0 else dim
                dim_size = shape[sharded] if 0 <= sharded < len(shape) else None
                table.row(unit_id, label, axis, kind, dim, len(shape), shape[0] if shape else None, dim_size)

    def _parameter_shapes(
        self, rows: list[int], modules: Sequence[nn.Module | None], fqns: Sequence[str], path: str, *, need_shape: bool
    ) -> list[tuple[int, ...] | None]:
        """The shape of parameter ``path`` of each module (``None``: not found).

        Without ``need_shape`` (no placement of it is ``Shard``) only presence matters: ``()`` then
        stands for "present", so no parameter is touched for nothing."""
        if modules[rows[0]] is None:
            if self.param_shapes is None:
                return [None] * len(rows)
            given = self.param_shapes
            return [_tuple(given.get(f"{fqns[row]}.{path}" if fqns[row] else path)) for row in rows]
        if not need_shape and "." not in path:
            # Rust reads the rows in place: a list of 188k modules would touch each one for nothing.
            every = modules if isinstance(modules, list) else list(modules)
            present: list[tuple[int, ...] | None] = [()] * len(rows)
            for position in _core.modules_lacking(every, path, None if len(rows) == len(every) else rows):
                present[position] = None
            return present
        selected = modules if isinstance(modules, list) and len(rows) == len(modules) else [modules[row] for row in rows]
        if "." in path:
            parameters = [_get_parameter(module, path) for module in selected]
        else:
            parameters = list(map(dict.get, map(_PARAMETERS, selected), repeat(path)))
        missing = any(map(is_, parameters, repeat(None)))  # not `None in`: that calls Tensor.__eq__
        if not need_shape:
            return [None if p is None else () for p in parameters]
        # A torch.Size is a tuple: one `shape` read per parameter (a tensor attribute costs ~0.1 µs).
        return [None if p is None else p.shape for p in parameters] if missing else list(map(_SHAPE, parameters))

    @staticmethod
    def _missing(module: nn.Module | None, fqn: str, path: str) -> str:
        if module is None:
            return f"params[{path!r}]: no shape was given for parameter {f'{fqn}.{path}' if fqn else path!r}"
        nearest = _nearest_parameters(module, path)
        hint = did_you_mean([repr(name) for name in nearest])
        return f"params[{path!r}] names a parameter the module ({type(module).__qualname__}) lacks{hint}"

    def _run_validator(
        self,
        row: int,
        modules: Sequence[nn.Module | None],
        specs: Sequence[ParallelModuleSpec],
        shardings: Sequence[ModuleShardingSpec],
        failures: dict[int, Failure],
    ) -> None:
        """The spec's own ``validate`` of one module with no other problem."""
        spec = specs[row]
        try:
            returned = spec.validate(module=modules[row], sharding=shardings[row], context=self.context)  # type: ignore[misc]
        except Exception as error:
            failures[row] = (ProblemCode.VALIDATOR, f"{spec.protocol} validate failed: {type(error).__name__}: {error}")
        else:
            if returned is not None:
                failures[row] = (ProblemCode.VALIDATOR, f"{spec.protocol} validate returned {returned!r}: {RAISE_TO_REJECT}")

    def _flatten(self, sharding: ModuleShardingSpec) -> _ShardingTemplate:
        rows: list[tuple[int, int, PlacementKind, int, str | None]] = []
        problems: list[str] = []
        fields: list[tuple[str, Mapping[str, Placement] | None, str | None]] = [
            (f"params[{path!r}]", placements, path) for path, placements in sharding.params.items()
        ]
        fields += [(name, getattr(sharding, name), None) for name in ("in_src", "in_dst", "out_src", "out_dst")]
        for label_text, placements, path in fields:
            if placements is None:
                continue
            label = self._table.label(label_text, path is not None)
            for axis, placement in placements.items():
                kind = _placement_kind(placement)
                if kind is None:
                    problems.append(f"{label_text} on axis '{axis}' is an unsupported placement {placement}")
                    continue
                rows.append((label, self._table.axis(self._spelled.get(axis, axis)), kind[0], kind[1], path))
        parameters: dict[str, bool] = {}
        for _, _, placement_kind, _, path in rows:
            if path is not None:
                parameters[path] = parameters.get(path, False) or placement_kind == _SHARD
        return _ShardingTemplate(sharding_failure(sharding), tuple(rows), tuple(parameters.items()), tuple(problems))


def _expert_count(spec: ParallelModuleSpec) -> int | Failure | None:
    """``num_experts`` of an ``ep`` spec for rule 5 (``None`` for another kind); a count that is
    not an int from 1 to 2**63 - 1 (what Rust's arithmetic takes) is the spec's failure."""
    if spec.binding_kind != "ep":
        return None
    value = spec.options["num_experts"]
    if not isinstance(value, int) or isinstance(value, bool):
        return (ProblemCode.EXPERT, f"options['num_experts'] must be an int, got {type(value).__name__} {value!r}")
    if not is_int_from(value, 1):
        return (ProblemCode.EXPERT, f"num_experts must be at least 1 and at most 2**63 - 1, got {value}")
    return value


def _tuple(shape: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if shape is None else tuple(shape)


def _get_parameter(module: nn.Module | None, path: str) -> Any:
    if module is None:
        return None
    try:
        return module.get_parameter(path)
    except AttributeError:
        return None


def _nearest_parameters(module: nn.Module, path: str) -> tuple[str, ...]:
    """The parameters nearest to ``path`` ("did you mean"): the module's own and those of the
    submodule the path's prefix names, so each module costs the same however deep its subtree."""
    candidates = [name for name, parameter in module._parameters.items() if parameter is not None]
    prefix = path.rpartition(".")[0]
    if prefix:
        try:
            owner = module.get_submodule(prefix)
        except AttributeError:
            owner = None
        if owner is not None:
            candidates += [f"{prefix}.{name}" for name, parameter in owner._parameters.items() if parameter is not None]
    return _nearest_names(tuple(candidates), path)


@functools.lru_cache(maxsize=1024)
def _nearest_names(candidates: tuple[str, ...], path: str) -> tuple[str, ...]:
    """Once per distinct parameter names and path: the modules of a class missing the same
    parameter share one answer, rather than one index each."""
    return tuple(_core.PatternSet([]).index_names(list(candidates), prune=False).nearest(path, 3))
