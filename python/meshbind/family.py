"""Family modules: classes that own their parallel protocol.

A class joins every plan without a request by declaring ``parallel_spec`` (a class attribute
written in its body, or a base's) and ``parallel_sharding(self, fqn, context)``. Resolution
records on each member the layout it was planned with, applied when the module is bound with that
very layout; binding records the layout it bound as applied on its mesh.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from meshbind.specs import FAMILY_DECLARATIONS, ModuleShardingSpec, ParallelModuleSpec

_BUILD_INFO = "_meshbind_family_build_info"
_BOUND = "_meshbind_family_bound"
_DISTRIBUTED = "_meshbind_family_distributed"


@dataclass(frozen=True)
class FamilyLayout:
    """The spec and sharding a family module was planned with, and the mesh it is bound on."""

    spec: ParallelModuleSpec
    sharding: ModuleShardingSpec
    applied_on: object | None = None
    """The ``MeshContext`` the layout was bound on; ``None`` while un-applied."""
    distributed_on: object | None = None
    """The ``MeshContext`` whose meshes ``apply_layouts`` distributed its parameters on."""

    @property
    def applied(self) -> bool:
        return self.applied_on is not None

    def __deepcopy__(self, memo: dict[int, object]) -> FamilyLayout:
        return self  # immutable, and its mesh context is the one the copy is bound on too


@dataclass(frozen=True)
class FamilyBuildInfo:
    """What meshbind knows about a family module; ``layout`` is ``None`` until a plan resolves it."""

    spec: ParallelModuleSpec
    fqn: str | None = None
    layout: FamilyLayout | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> FamilyBuildInfo:
        return self  # immutable: a copied module (a pipeline stage's) keeps its FQN and layout


def family_spec(cls: type) -> object:
    """The class's ``parallel_spec`` attribute (static lookup), or ``None`` when it has none."""
    for klass in cls.__mro__:
        if "parallel_spec" in klass.__dict__:
            return klass.__dict__["parallel_spec"]
    return None


def family_classes_declared() -> bool:
    """Whether some living class declares a ``parallel_spec`` in its body (registered as it is
    defined). When none does, no module of any tree is a family member, and resolution need not
    visit modules no pattern reaches."""
    return bool(FAMILY_DECLARATIONS)


def get_family_build_info(module: nn.Module) -> FamilyBuildInfo:
    """The build info of a family module; a ``ValueError`` when its class owns no protocol."""
    spec = family_spec(type(module))
    if not isinstance(spec, ParallelModuleSpec):
        raise ValueError(f"{type(module).__qualname__} is not a family module: its class has no ParallelModuleSpec parallel_spec")
    info = module.__dict__.get(_BUILD_INFO)
    return info if isinstance(info, FamilyBuildInfo) else FamilyBuildInfo(spec=spec)


def record_family_layout(module: nn.Module, fqn: str, spec: ParallelModuleSpec, sharding: ModuleShardingSpec) -> None:
    """Record a resolved layout: applied when the module is bound with this very spec and sharding,
    distributed when ``apply_layouts`` made its parameters DTensors with it."""

    def same_layout(record_name: str) -> FamilyLayout | None:
        record = module.__dict__.get(record_name)
        same = isinstance(record, FamilyLayout) and record.spec == spec and record.sharding == sharding
        return record if same else None

    bound, distributed = same_layout(_BOUND), same_layout(_DISTRIBUTED)
    layout = FamilyLayout(spec, sharding, bound and bound.applied_on, distributed and distributed.distributed_on)
    module.__dict__[_BUILD_INFO] = FamilyBuildInfo(spec=spec, fqn=fqn, layout=layout)


def record_family_binding(
    module: nn.Module, fqn: str, spec: ParallelModuleSpec, sharding: ModuleShardingSpec, mesh_context: object
) -> None:
    """Record that the module is bound with this layout on this mesh; its build info now shows it applied."""
    module.__dict__[_BOUND] = FamilyLayout(spec, sharding, mesh_context)
    record_family_layout(module, fqn, spec, sharding)


def record_family_distribution(
    module: nn.Module, fqn: str, spec: ParallelModuleSpec, sharding: ModuleShardingSpec, mesh_context: object
) -> None:
    """Record that ``apply_layouts`` distributed the module's parameters with this layout on this mesh."""
    module.__dict__[_DISTRIBUTED] = FamilyLayout(spec, sharding, distributed_on=mesh_context)
    record_family_layout(module, fqn, spec, sharding)
