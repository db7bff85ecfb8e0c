"""The specs a plan is written in: frozen, validated on construction, read-only inside."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch.distributed.tensor import Placement

from meshbind._core import check_patterns
from meshbind.units import is_int_from
from meshbind.world import World

if TYPE_CHECKING:
    from torch import nn

    from meshbind._core import ModuleTree
    from meshbind.errors import PlanProblem

BINDING_KINDS = ("none", "cp", "ep", "mesh")


NamedPlacement = Mapping[str, Placement]
"""A placement per mesh axis: ``{"ep": Shard(0)}``."""

ShardingProvider = Callable[["nn.Module | None", str, "LayoutContext"], "ModuleShardingSpec"]
"""``sharding(module, fqn, context)``; offline (a plan over FQNs only) ``module`` is ``None``."""


def _set(instance: object, name: str, value: object) -> None:
    object.__setattr__(instance, name, value)


def _non_empty_str(owner: str, name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{owner}.{name} must be a non-empty str, got {value!r}")


def literal_pattern(fqn: str) -> str:
    """The pattern selecting exactly ``fqn``: every character that could mean something escaped."""
    return "".join(char if char.isalnum() or char in "._" else "\\" + char for char in fqn) if fqn else ""


@dataclass(frozen=True, eq=True)
class ParallelModuleSpec:
    """What a module's parallel protocol is: its binding kind, its stages and its checks."""

    protocol: str
    binding_kind: str = "none"
    stages: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    validate: Callable[..., None] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    version: str = "1"
    validate_materialized: Callable[..., None] | None = None

    def __post_init__(self) -> None:
        owner = "ParallelModuleSpec"
        _non_empty_str(owner, "protocol", self.protocol)
        _non_empty_str(owner, "version", self.version)
        if self.binding_kind not in BINDING_KINDS:
            raise ValueError(f"{owner}.binding_kind must be one of {BINDING_KINDS}, got {self.binding_kind!r}")
        _set(self, "stages", MappingProxyType(_read_stages(self.stages)))
        if not isinstance(self.options, Mapping):
            raise ValueError(f"{owner}.options must be a mapping, got {type(self.options).__name__}")
        try:
            options = copy.deepcopy(dict(self.options))
        except Exception as error:  # deepcopy raises whatever the value's own copy hooks raise
            raise ValueError(f"{owner}.options must be deep-copyable: {type(error).__name__}: {error}") from error
        _set(self, "options", MappingProxyType(options))
        for name in ("validate", "validate_materialized"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ValueError(f"{owner}.{name} must be callable or None, got {type(value).__name__}")
        if self.binding_kind != "none":
            if not self.stages:
                raise ValueError(f"{owner}.stages: binding_kind {self.binding_kind!r} requires at least one stage")
            if self.validate is None:
                raise ValueError(f"{owner}.validate: binding_kind {self.binding_kind!r} requires a validate callable")
        if self.binding_kind == "ep" and "num_experts" not in self.options:
            raise ValueError(f"{owner}.options: an 'ep' spec must carry options['num_experts']")

    def __hash__(self) -> int:
        # Callables and options take part in equality but not in the hash (options may be unhashable).
        return hash((self.protocol, self.binding_kind, self.version, tuple(self.stages.items())))

    def describe(self) -> str:
        return f"{self.protocol} v{self.version} ({self.binding_kind})"

    def __set_name__(self, owner: type, name: str) -> None:
        # Python calls this for a spec written in a class body: how family classes are declared.
        if name == "parallel_spec":
            FAMILY_DECLARATIONS.add(owner)


FAMILY_DECLARATIONS: weakref.WeakSet[type] = weakref.WeakSet()
"""Every class (a module or a mixin) whose body declares a ``parallel_spec``, while it lives."""


def _read_stages(stages: object) -> dict[str, tuple[str, ...]]:
    if not isinstance(stages, Mapping):
        raise ValueError(
            f"ParallelModuleSpec.stages must be a mapping of method name to keyword names, got {type(stages).__name__}"
        )
    result: dict[str, tuple[str, ...]] = {}
    for method, names in stages.items():
        if not isinstance(method, str) or not method.isidentifier():
            raise ValueError(f"ParallelModuleSpec.stages: stage name {method!r} is not a method name")
        if isinstance(names, str) or not isinstance(names, Sequence):
            raise ValueError(f"ParallelModuleSpec.stages[{method!r}] must be a sequence of keyword names, got {names!r}")
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"ParallelModuleSpec.stages[{method!r}]: {name!r} is not a keyword name")
        result[method] = tuple(names)
    return result


def _read_named_placement(where: str, value: object) -> Mapping[str, Placement]:
    if not isinstance(value, Mapping):
        raise ValueError(f"ModuleShardingSpec.{where} must be a mapping of axis name to Placement, got {type(value).__name__}")
    for axis, placement in value.items():
        if not isinstance(axis, str) or not axis:
            raise ValueError(f"ModuleShardingSpec.{where}: axis name {axis!r} must be a non-empty str")
        if not isinstance(placement, Placement):
            raise ValueError(
                f"ModuleShardingSpec.{where}[{axis!r}] must be a torch.distributed.tensor Placement "
                f"(Shard, Replicate, Partial), got {type(placement).__name__}"
            )
    return MappingProxyType(dict(value))


@dataclass(frozen=True)
class ModuleShardingSpec:
    """The layout a module owns: named placements of its parameters, inputs and outputs.

    ``expert_stack`` is internal: the number of per-expert modules a layout still stacks. Explicit
    stage modules own fused ``[E, ...]`` parameters and must never carry one (the explicit-stage rule).
    """

    params: Mapping[str, NamedPlacement] = field(default_factory=dict)
    in_src: NamedPlacement = field(default_factory=dict)
    in_dst: NamedPlacement = field(default_factory=dict)
    out_src: NamedPlacement = field(default_factory=dict)
    out_dst: NamedPlacement | None = None
    expert_stack: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.params, Mapping):
            raise ValueError(
                f"ModuleShardingSpec.params must be a mapping of parameter path to placements, got {type(self.params).__name__}"
            )
        params = {}
        for path, placement in self.params.items():
            if not isinstance(path, str) or not path:
                raise ValueError(f"ModuleShardingSpec.params: parameter path {path!r} must be a non-empty str")
            params[path] = _read_named_placement(f"params[{path!r}]", placement)
        _set(self, "params", MappingProxyType(params))
        for name in ("in_src", "in_dst", "out_src"):
            _set(self, name, _read_named_placement(name, getattr(self, name)))
        if self.out_dst is not None:
            _set(self, "out_dst", _read_named_placement("out_dst", self.out_dst))
        stack = self.expert_stack
        if stack is not None and (not isinstance(stack, int) or isinstance(stack, bool) or stack < 1):
            raise ValueError(f"ModuleShardingSpec.expert_stack must be None or a positive int, got {stack!r}")

    def to_dict(self) -> dict[str, Any]:
        def named(value: NamedPlacement) -> dict[str, str]:
            return {axis: repr(p) for axis, p in value.items()}

        return {
            "params": {path: named(p) for path, p in self.params.items()},
            "in_src": named(self.in_src),
            "in_dst": named(self.in_dst),
            "out_src": named(self.out_src),
            "out_dst": None if self.out_dst is None else named(self.out_dst),
        }


SHARDING_FIELDS = ("params", "in_src", "in_dst", "out_src", "out_dst")
"""The fields an override may set."""


@dataclass(frozen=True)
class NativeParallelBindingRequest:
    """Binds existing components, selected by FQN patterns, to a parallel spec and a layout.

    A pattern of a ``required`` request that selects nothing is an ``unmatched`` problem; of an
    optional one (``required=False``), a warning in ``ParallelPlan.warnings``."""

    match: tuple[str, ...]
    parallel: ParallelModuleSpec
    sharding: ShardingProvider
    required: bool = True

    def __post_init__(self) -> None:
        owner = "NativeParallelBindingRequest"
        if isinstance(self.match, str):
            raise ValueError(f"{owner}.match must be a tuple of patterns, not a bare str: write ({self.match!r},)")
        if not isinstance(self.match, Sequence) or not self.match:
            raise ValueError(f"{owner}.match must be a non-empty tuple of pattern strings, got {self.match!r}")
        for pattern in self.match:
            if not isinstance(pattern, str):
                raise ValueError(f"{owner}.match: every pattern must be a str, got {pattern!r}")
        _set(self, "match", tuple(self.match))
        check_patterns(self.match)  # raises PatternError (a ValueError) naming the malformed pattern
        if not isinstance(self.parallel, ParallelModuleSpec):
            raise ValueError(f"{owner}.parallel must be a ParallelModuleSpec, got {type(self.parallel).__name__}")
        if not callable(self.sharding):
            raise ValueError(
                f"{owner}.sharding must be a callable sharding(module, fqn, context), got {type(self.sharding).__name__}"
            )
        if not isinstance(self.required, bool):
            raise ValueError(f"{owner}.required must be a bool, got {self.required!r}")


@dataclass(frozen=True)
class LayoutContext:
    """The logical layout a plan is checked against: the size of every mesh axis, as given
    (``dp`` stays ``dp``), and the ``World`` they make, whose rules are checked here."""

    axis_sizes: Mapping[str, int]
    world: World = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.axis_sizes, Mapping):
            raise ValueError(
                f"LayoutContext.axis_sizes must be a mapping of axis name to size, got {type(self.axis_sizes).__name__}"
            )
        for axis, size in self.axis_sizes.items():
            if not isinstance(axis, str) or not axis:
                raise ValueError(f"LayoutContext.axis_sizes: axis name {axis!r} must be a non-empty str")
            if not is_int_from(size, 1):
                raise ValueError(f"LayoutContext.axis_sizes[{axis!r}] must be an int from 1 to 2**63 - 1, got {size!r}")
        _set(self, "axis_sizes", MappingProxyType(dict(self.axis_sizes)))
        try:
            _set(self, "world", World.of(self.axis_sizes))
        except ValueError as error:
            raise ValueError(f"LayoutContext: {error}") from None

    def __hash__(self) -> int:
        return hash(tuple(self.axis_sizes.items()))

    def size(self, axis: str) -> int:
        """The size of ``axis``; a clear ``ValueError`` when the context has no such axis."""
        if axis not in self.axis_sizes:
            raise ValueError(f"the layout context has no {axis!r} axis (axes: {', '.join(self.axis_sizes) or 'none'})")
        return self.axis_sizes[axis]


@dataclass(frozen=True)
class SourcedRequests:
    """What a plan source gives ``resolve_plan`` for one context: its requests, and the findings of
    its own reading of the plan (a key that selects nothing), as problems or as warnings."""

    requests: Sequence[NativeParallelBindingRequest]
    problems: Sequence[PlanProblem] = ()
    warnings: Sequence[PlanProblem] = ()


@runtime_checkable
class PlanSource(Protocol):
    """A plan written for another framework (``from_hf_plan``), turned into requests only once the
    axes are known: which of its rules apply depends on them (Hugging Face drops its EP plan at
    ``ep=1``, and every TP rule on an expert module at ``ep > 1``). It reads a module tree through
    the whole walk ``resolve_plan`` made of it (``model_index.walk_whole``: every FQN and
    parameter, nothing matched; ``PatternSet.match_tree`` matches its keys over it), offline the
    sequence of FQNs: the model is walked once for the source, the selection and the index."""

    def requests_for(self, model: ModuleTree | Sequence[str], context: LayoutContext) -> SourcedRequests: ...
