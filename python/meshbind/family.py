"""Family modules: classes that own their parallel protocol (SPEC §3).

A class joins every plan without a request by declaring ``parallel_spec`` (a class attribute) and
``parallel_sharding(self, fqn, context)``. Resolution records on each member the layout it was
planned with; binding marks that layout applied on the mesh it was bound to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from meshbind.specs import ModuleShardingSpec, ParallelModuleSpec

_BUILD_INFO = "_meshbind_family_build_info"


@dataclass(frozen=True)
class FamilyLayout:
    """The spec and sharding a family module was planned with, and the mesh it is bound on."""

    spec: ParallelModuleSpec
    sharding: ModuleShardingSpec
    applied_on: object | None = None
    """The ``MeshContext`` the layout was bound on; ``None`` while un-applied."""

    @property
    def applied(self) -> bool:
        return self.applied_on is not None


@dataclass(frozen=True)
class FamilyBuildInfo:
    """What meshbind knows about a family module; ``layout`` is ``None`` until a plan resolves it."""

    spec: ParallelModuleSpec
    fqn: str | None = None
    layout: FamilyLayout | None = None


def family_spec(cls: type) -> object:
    """The class's ``parallel_spec`` attribute (static lookup), or ``None`` when it has none."""
    for klass in cls.__mro__:
        if "parallel_spec" in klass.__dict__:
            return klass.__dict__["parallel_spec"]
    return None


def any_family_class() -> bool:
    """Whether ``nn.Module`` or any subclass now defined has a ``parallel_spec`` (its own or
    inherited, also from a base that is no module, as a mixin).

    Every module's class is one of them, so when none has one no module of any tree can be a
    family member, and resolution need not visit modules no pattern reaches.
    """
    classes = [nn.Module]
    seen = set(classes)
    for cls in classes:  # grows while it is read: every subclass, breadth first
        for subclass in type.__subclasses__(cls):
            if subclass not in seen:
                seen.add(subclass)
                classes.append(subclass)
    return any(getattr(cls, "parallel_spec", None) is not None for cls in classes)


def get_family_build_info(module: nn.Module) -> FamilyBuildInfo:
    """The build info of a family module; a ``ValueError`` when its class owns no protocol."""
    spec = family_spec(type(module))
    if not isinstance(spec, ParallelModuleSpec):
        raise ValueError(f"{type(module).__qualname__} is not a family module: its class has no ParallelModuleSpec parallel_spec")
    info = module.__dict__.get(_BUILD_INFO)
    return info if isinstance(info, FamilyBuildInfo) else FamilyBuildInfo(spec=spec)


def record_family_layout(module: nn.Module, fqn: str, spec: ParallelModuleSpec, sharding: ModuleShardingSpec) -> None:
    """Record a resolved layout; a layout already applied with the same spec and sharding stays applied."""
    previous = module.__dict__.get(_BUILD_INFO)
    applied_on = None
    if isinstance(previous, FamilyBuildInfo) and previous.layout is not None:
        if previous.layout.spec == spec and previous.layout.sharding == sharding:
            applied_on = previous.layout.applied_on
    layout = FamilyLayout(spec=spec, sharding=sharding, applied_on=applied_on)
    module.__dict__[_BUILD_INFO] = FamilyBuildInfo(spec=spec, fqn=fqn, layout=layout)


def set_family_applied(module: nn.Module, applied_on: object | None) -> None:
    """Mark the recorded layout applied on a mesh (or un-applied with ``None``)."""
    info = module.__dict__.get(_BUILD_INFO)
    if isinstance(info, FamilyBuildInfo) and info.layout is not None:
        module.__dict__[_BUILD_INFO] = replace(info, layout=replace(info.layout, applied_on=applied_on))
