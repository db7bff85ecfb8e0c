"""FSDP units: which modules ``fully_shard`` groups, on which mesh, and every unit it
would refuse or get wrong, found before anything changes.

A unit's own parameters are those under it that no deeper unit holds. They all live on one mesh:
on the expert mesh when the plan places them on ``ep``, else on the device mesh. FSDP shards a
parameter's dim 0 over the unit's data-parallel axes, so a parameter the plan already places on
one of those axes, on none at all (replicated over the whole mesh, FSDP's axes included), or on
two (FSDP composes with one TP or EP dim) is refused, as are a container without ``forward``, a
parameter tied across two units, a 0-d parameter and a unit mixing dtypes (one all-gather
buffer per unit).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Placement

from meshbind._core import PatternSet
from meshbind.errors import PlanProblem, ProblemCode, did_you_mean, index_groups
from meshbind.fsdp_request import FullyShard, UnitPrecision
from meshbind.model_index import ModelIndex, ParameterKind
from meshbind.names import MeshSide
from meshbind.resolution.unmatched import ModelNames
from meshbind.specs import ModuleShardingSpec, literal_pattern
from meshbind.world import EXPERT_AXES, MODEL_PARALLEL_AXIS, canonical_axis


@dataclass(frozen=True)
class FSDPUnit:
    """One ``fully_shard`` call: the module's FQN (``""``: the root), its mesh side and its
    mixed-precision policy."""

    fqn: str
    mesh: MeshSide
    """The device mesh (sharded over ``dp_shard · cp``) or the expert mesh (over ``edp_shard``)."""
    policy: MixedPrecisionPolicy | None = None
    """torch's policy for this unit: the plan's, or a ``UnitPrecision``'s that selects it
    (``None``: each parameter's own dtype)."""


@dataclass(frozen=True)
class FSDPPlan:
    """The units in the order ``fully_shard`` is applied: bottom-up, the root last."""

    units: tuple[FSDPUnit, ...]
    reshard_after_forward: bool | None
    by_default: bool = False
    """Whether the units are torchtitan's defaults, chosen because ``dp_shard`` is above 1 and the
    plan named none."""
    policy: MixedPrecisionPolicy | None = None
    """torch's mixed-precision policy of the plan (``None``: each parameter's own dtype); a unit a
    ``UnitPrecision`` selects has its own (``FSDPUnit.policy``)."""

    def unit_of(self, parameter_fqn: str) -> FSDPUnit:
        """The innermost unit holding a parameter (the root holds what no other does)."""
        by_fqn = self._by_fqn
        return by_fqn[_innermost(parameter_fqn, by_fqn)]

    @functools.cached_property
    def _by_fqn(self) -> dict[str, FSDPUnit]:
        return {unit.fqn: unit for unit in self.units}

    def to_dict(self) -> dict[str, object]:
        return {
            "units": [
                {
                    "fqn": unit.fqn,
                    "mesh": unit.mesh,
                    "mixed_precision": None if unit.policy is None else policy_fields(unit.policy),
                }
                for unit in self.units
            ],
            "reshard_after_forward": self.reshard_after_forward,
            "by_default": self.by_default,
            "mixed_precision": None if self.policy is None else policy_fields(self.policy),
        }

    def with_policy(self, policy: MixedPrecisionPolicy | None) -> FSDPPlan:
        """The same units under another plan-wide policy; a unit with a policy of its own keeps it.
        No problem of the units depends on the plan's policy, so the plan a ``FullyShard`` of other
        dtypes resolves to is this one's ``with_policy``."""
        units = tuple(unit if unit.policy != self.policy else dataclasses.replace(unit, policy=policy) for unit in self.units)
        return dataclasses.replace(self, units=units, policy=policy)

    def describe(self) -> str:
        """One line: the units in the order ``fully_shard`` takes them, and who chose them."""
        grouped = index_groups([(unit.fqn or "<root>", unit.mesh) for unit in self.units])
        units = ", ".join(f"{fqn} ({self.units[members[0]].mesh})" for fqn, members in grouped)
        chosen = " (none named: torchtitan's default units)" if self.by_default else ""
        described = f"FSDP units{chosen}, in the order fully_shard takes them: {units}"
        if self.policy is not None:
            described += f"; mixed precision {policy_text(self.policy)}"
        own = [(unit.fqn or "<root>", unit.policy) for unit in self.units if unit.policy != self.policy]
        for fqn, members in index_groups(own):
            described += f"; {fqn}: {policy_text(own[members[0]][1])}"
        return described


def policy_fields(policy: MixedPrecisionPolicy) -> dict[str, str | bool | None]:
    """The policy's fields as text: dtypes by name (``None`` keeps the parameter's)."""
    dtypes = {name: getattr(policy, name) for name in ("param_dtype", "reduce_dtype", "output_dtype")}
    named: dict[str, str | bool | None] = {
        name: None if dtype is None else str(dtype).removeprefix("torch.") for name, dtype in dtypes.items()
    }
    return {**named, "cast_forward_inputs": policy.cast_forward_inputs}


def policy_text(policy: MixedPrecisionPolicy | None) -> str:
    """The policy as the plan's table says it (``None``: each parameter's own dtype)."""
    if policy is None:
        return "each parameter's own dtype"
    return ", ".join(f"{name} {value}" for name, value in policy_fields(policy).items())


def mixed_precision_policy(request: FullyShard | UnitPrecision) -> MixedPrecisionPolicy | None:
    """torch's policy for the request's dtypes; ``None`` when a ``FullyShard`` sets none (a
    ``UnitPrecision`` always gives its unit a policy, torch's defaults included)."""
    if isinstance(request, FullyShard) and not request.mixed_precision:
        return None
    return MixedPrecisionPolicy(request.param_dtype, request.reduce_dtype, request.output_dtype, request.cast_forward_inputs)


DEFAULT_UNITS_SOURCE = "fully_shard (default units)"
"""The request a problem of default units names."""


def default_fully_shard(model: ModelIndex | Sequence[str], sharding: Mapping[str, ModuleShardingSpec]) -> FullyShard:
    """torchtitan's units: each block of the model's layer list (its longest ``ModuleList``, or
    offline the FQN with the most numbered children), each planned module that places a parameter
    on ``ep`` (its experts), then the root. A model with neither is one unit, the root."""
    blocks = model.layer_list() if isinstance(model, ModelIndex) else _numbered_list(model)
    units = []
    if blocks is not None:
        units.append(f"{literal_pattern(blocks)}.*" if blocks else "*")
    expert_axis = MODEL_PARALLEL_AXIS[MeshSide.EXPERT]
    for module_fqn, spec in sharding.items():
        # The root is always the last unit: an expert root needs no pattern of its own.
        if module_fqn and any(canonical_axis(axis) == expert_axis for named in spec.params.values() for axis in named):
            units.append(literal_pattern(module_fqn))
    return FullyShard(tuple(dict.fromkeys(units)))


def _numbered_list(model: Sequence[str]) -> str | None:
    """Offline, the FQN with the most numbered children, ``None`` when none has any."""
    numbered: dict[str, int] = {}
    for fqn in model:
        parent, _, name = fqn.rpartition(".")
        if name.isdigit():
            numbered[parent] = numbered.get(parent, 0) + 1
    return max(numbered, key=lambda parent: numbered[parent]) if numbered else None


def fsdp_units(
    model: ModelIndex | Sequence[str],
    request: FullyShard,
    sharding: Mapping[str, ModuleShardingSpec],
    *,
    by_default: bool = False,
) -> tuple[FSDPPlan | None, list[PlanProblem]]:
    """The units ``request`` names on the indexed model and every problem of them. Offline (a
    sequence of FQNs) only the patterns are matched: the parameters are not known. ``by_default``:
    the units are ``default_fully_shard``'s, and their problems say so."""
    assert request.units is not None  # resolution replaces "the default units" by them first
    fqns, problems = _selected(model, request)
    ordered = sorted(dict.fromkeys(fqns), key=lambda fqn: -fqn.count(".") - 1 if fqn else 0)
    ordered = [fqn for fqn in ordered if fqn] + [""]
    policy = mixed_precision_policy(request)
    policies, found = _unit_policies(ordered, request, policy)
    problems += found
    if not isinstance(model, ModelIndex):
        units_offline = tuple(FSDPUnit(fqn, MeshSide.DEVICE, policies[fqn]) for fqn in ordered)
        return FSDPPlan(units_offline, request.reshard_after_forward, by_default, policy), problems
    units = set(ordered)
    placed = _placements(sharding)
    members: dict[str, list[tuple[str, ParameterKind]]] = {fqn: [] for fqn in ordered}
    for fqn, kind in model.parameters():
        members[_innermost(fqn, units)].append((fqn, kind))
    for later, first in model.ties.items():
        unit, first_unit = _innermost(later, units), _innermost(first, units)
        if unit != first_unit:
            problems.append(
                _problem(
                    later,
                    f"is tied to {first!r}, which the FSDP unit {_unit_name(first_unit)} holds, while the unit "
                    f"{_unit_name(unit)} holds it: FSDP shards a parameter in one unit; make both one unit",
                )
            )
    sides = {}
    for fqn in ordered:
        sides[fqn], unit_problems = _unit_side(fqn, model.class_of(fqn), members[fqn], placed)
        problems += unit_problems
    planned = tuple(FSDPUnit(fqn, sides[fqn], policies[fqn]) for fqn in ordered)
    plan = FSDPPlan(planned, request.reshard_after_forward, by_default, policy)
    if by_default:
        problems = [dataclasses.replace(problem, request=DEFAULT_UNITS_SOURCE) for problem in problems]
    return plan, problems


def _selected(model: ModelIndex | Sequence[str], request: FullyShard) -> tuple[list[str], list[PlanProblem]]:
    assert request.units is not None
    patterns = PatternSet(list(request.units))
    tree = patterns.index_names(list(model.names if isinstance(model, ModelIndex) else model))
    problems = []
    names: ModelNames | None = None
    for pattern, count in zip(request.units, tree.hit_counts(), strict=True):
        if count == 0:
            names = names or ModelNames.of(model)
            nearest = names.nearest(pattern)
            hint = did_you_mean(nearest)
            message = f"pattern {pattern!r} does not select any module{hint}"
            problems.append(PlanProblem(ProblemCode.UNMATCHED, None, "fully_shard", message, about="pattern"))
    return [fqn for fqn, _ in tree.matches()], problems


def _unit_policies(
    units: Sequence[str], request: FullyShard, policy: MixedPrecisionPolicy | None
) -> tuple[dict[str, MixedPrecisionPolicy | None], list[PlanProblem]]:
    """Each unit's policy: the plan's, or that of the one ``UnitPrecision`` selecting it. A unit
    policy that selects no unit, or a unit two of them select, is a problem."""
    policies: dict[str, MixedPrecisionPolicy | None] = dict.fromkeys(units, policy)
    if not request.unit_policies:
        return policies, []
    problems = []
    patterns = PatternSet([unit_policy.units for unit_policy in request.unit_policies])
    tree = patterns.index_names(list(units), prune=False)
    for index, count in enumerate(tree.hit_counts()):
        if count == 0:
            nearest = did_you_mean([repr(name) for name in tree.nearest(request.unit_policies[index].units, 3)])
            message = f"pattern {request.unit_policies[index].units!r} selects no FSDP unit{nearest}"
            problems.append(
                PlanProblem(ProblemCode.UNMATCHED, None, f"fully_shard.unit_policies[{index}]", message, about="pattern")
            )
    for fqn, hits in tree.matches():
        if len(hits) > 1:
            message = f"is selected by unit_policies {list(hits)}: give each unit one policy"
            problems.append(_problem(fqn, message))
        policies[fqn] = mixed_precision_policy(request.unit_policies[hits[0]])
    return policies, problems


def _placements(sharding: Mapping[str, ModuleShardingSpec]) -> dict[str, Mapping[str, Placement]]:
    """Each planned parameter's named placements, by its FQN."""
    placed = {}
    for module_fqn, spec in sharding.items():
        prefix = f"{module_fqn}." if module_fqn else ""
        for path, named in spec.params.items():
            placed[prefix + path] = named
    return placed


def _innermost(parameter_fqn: str, units: Container[str]) -> str:
    """The deepest unit FQN that is a prefix of ``parameter_fqn`` (``""``: the root)."""
    prefix = parameter_fqn
    while prefix:
        prefix = prefix.rpartition(".")[0]
        if prefix in units:
            return prefix
    return ""


def _unit_side(
    fqn: str, cls: type, members: list[tuple[str, ParameterKind]], placed: Mapping[str, Mapping[str, Placement]]
) -> tuple[MeshSide, list[PlanProblem]]:
    """The unit's mesh side and the problems of its module (of class ``cls``) and own parameters."""
    problems = []
    if issubclass(cls, (nn.ModuleList, nn.ModuleDict)):
        problems.append(
            _problem(
                fqn,
                f"is a {cls.__name__}, which fully_shard refuses (it has no forward to hook): "
                f"name its members as units ({fqn + '.*' if fqn else '*'})",
            )
        )
    sides = {name: _side(placed.get(name)) for name, _ in members}
    expert = [name for name, side in sides.items() if side is MeshSide.EXPERT]
    device = [name for name, side in sides.items() if side is MeshSide.DEVICE]
    if expert and device:
        # Named from the unit, so that alike units give one message (one line for every layer).
        inside = [name.removeprefix(f"{fqn}.") if fqn else name for name in (expert[0], device[0])]
        problems.append(
            _problem(
                fqn,
                f"holds parameters of the expert mesh ({inside[0]!r}) and of the device mesh ({inside[1]!r}): an FSDP unit "
                "shards over one mesh; make the expert module a unit of its own, as torchtitan wraps moe.experts",
            )
        )
    side = MeshSide.EXPERT if expert and not device else MeshSide.DEVICE
    for name, kind in members:
        problems += _parameter_problems(name, kind, placed.get(name), sides[name])
    dtypes = sorted({kind.dtype_name for _, kind in members})
    if len(dtypes) > 1:
        problems.append(
            _problem(fqn, f"holds parameters of {len(dtypes)} dtypes ({', '.join(dtypes)}): FSDP all-gathers a unit in one dtype")
        )
    return side, problems


def _side(named: Mapping[str, Placement] | None) -> MeshSide:
    return MeshSide.EXPERT if named and any(canonical_axis(axis) in EXPERT_AXES for axis in named) else MeshSide.DEVICE


def _parameter_problems(
    fqn: str, kind: ParameterKind, named: Mapping[str, Placement] | None, side: MeshSide
) -> Iterator[PlanProblem]:
    if kind.ndim == 0:
        yield _problem(fqn, "is a 0-d parameter: FSDP shards dim 0, which it does not have")
    if named is None:
        return
    allowed = MODEL_PARALLEL_AXIS[side]
    axes = [canonical_axis(axis) for axis in named]
    if not axes:
        yield _problem(
            fqn,
            f"is placed on no axis, which replicates it over the whole {side} mesh, FSDP's axes included: "
            f"place it on {allowed!r} or leave it out of the plan's params",
        )
    elif [axis for axis in axes if axis != allowed]:
        others = [axis for axis in axes if axis != allowed]
        yield _problem(
            fqn,
            f"is placed on {others}: in an FSDP unit a parameter may be placed on {allowed!r} only, since FSDP itself "
            f"shards it over the data-parallel axes (placing it there as well is placing it twice)",
        )


def _problem(fqn: str, message: str) -> PlanProblem:
    return PlanProblem(ProblemCode.FSDP, fqn, "fully_shard", message)


def _unit_name(fqn: str) -> str:
    return repr(fqn) if fqn else "<root>"
