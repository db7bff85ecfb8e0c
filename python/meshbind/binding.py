"""Binding a resolved plan to existing meshes: all or nothing, creating no group.

``bind_parallel_modules`` first prepares everything that can fail without side effects (finding
each module, checking its current owner, building the CP/EP contexts from prebuilt axis meshes),
then calls each module's ``bind_parallel``. If one raises, every module bound by this call is
restored before the error propagates, so a model is never left half-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from meshbind.agreement import check_ranks_agree, plan_agreement
from meshbind.cp import CPContext
from meshbind.ep import EPContext
from meshbind.errors import BindingError, BindingRefusedError, MaterializationError
from meshbind.family import family_spec, record_family_binding
from meshbind.mesh import MeshBinding, MeshContext, check_resolved_for
from meshbind.modules import submodule, unwrapped
from meshbind.resolution.plan import ParallelPlan
from meshbind.specs import ModuleShardingSpec, ParallelModuleSpec
from meshbind.validation.rules import RAISE_TO_REJECT, ClassFailures

_OWNER = "_meshbind_owner"
_RECORDS = "_meshbind_records"


@dataclass(frozen=True)
class ParallelBinding:
    """What a module's ``bind_parallel`` receives: the axis meshes, and its CP or EP context."""

    mesh_binding: MeshBinding
    cp_context: CPContext | None = None
    ep_context: EPContext | None = None


@dataclass(frozen=True)
class _Owner:
    """The plan entry and mesh a module is bound by."""

    spec: ParallelModuleSpec
    sharding: ModuleShardingSpec
    mesh_context: MeshContext
    binding: ParallelBinding


@dataclass(frozen=True)
class BoundModule:
    """A record of the plan on the model: what ``validate_materialized_modules`` checks."""

    fqn: str
    spec: ParallelModuleSpec
    binding: ParallelBinding | None


@dataclass
class _Prepared:
    fqn: str
    module: nn.Module
    spec: ParallelModuleSpec
    binding: ParallelBinding


def bind_parallel_modules(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> list[str]:
    """Bind every planned module whose kind is not ``none``; returns the FQNs bound by this call
    (a module already bound by the same entry on the same mesh is skipped)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan must be a ParallelPlan, got {type(plan).__name__}")
    mesh_binding = MeshBinding(mesh_context)
    check_resolved_for(plan.context, mesh_context)
    check_ranks_agree(
        "bind_parallel_modules", lambda: plan_agreement(model, plan, mesh_context), model=model, group=mesh_context.stage_group
    )
    prepared, unchanged = _prepare(model, plan, mesh_binding)
    bound: list[_Prepared] = []
    for entry in prepared:
        try:
            entry.module.bind_parallel(entry.binding)  # type: ignore[operator]
        except Exception as error:
            raise BindingError(entry.fqn, error, _restore(bound)) from error
        except BaseException:  # an interrupt is no failure to report, but it unwinds all the same
            _restore(bound)
            raise
        entry.module.__dict__[_OWNER] = _Owner(entry.spec, plan.sharding[entry.fqn], mesh_context, entry.binding)
        bound.append(entry)
    owned = bound + unchanged
    for entry in owned:
        if isinstance(family_spec(type(entry.module)), ParallelModuleSpec):
            record_family_binding(entry.module, entry.fqn, entry.spec, plan.sharding[entry.fqn], mesh_context)
    bindings = {entry.fqn: entry.binding for entry in owned}
    root = unwrapped(model)
    records = {record.fqn: record for record in root.__dict__.get(_RECORDS, ())}
    records |= {fqn: BoundModule(fqn, spec, bindings.get(fqn)) for fqn, spec in plan.parallel_modules.items()}
    root.__dict__[_RECORDS] = tuple(records.values())
    return [entry.fqn for entry in bound]


def _prepare(model: nn.Module, plan: ParallelPlan, mesh_binding: MeshBinding) -> tuple[list[_Prepared], list[_Prepared]]:
    """Every binding to make, and the modules already bound by the same entry; raises before any side effect."""
    mesh_context = mesh_binding.mesh_context
    cp_contexts: dict[str, CPContext] = {}
    ep_contexts: dict[int, EPContext] = {}
    # Rules 1 and 2 only where resolution did not prove them: a plan resolved offline, or over a
    # model whose module here has another class. Once per (class, spec).
    class_failures = ClassFailures()
    prepared: list[_Prepared] = []
    unchanged: list[_Prepared] = []
    proved = plan.classes or (None,) * len(plan.parallel_modules)
    for (fqn, spec), proved_class in zip(plan.parallel_modules.items(), proved, strict=True):
        if spec.binding_kind == "none":
            continue
        module = submodule(model, fqn)
        owner = module.__dict__.get(_OWNER)
        if isinstance(owner, _Owner):
            if owner.spec == spec and owner.sharding == plan.sharding[fqn] and owner.mesh_context.same_meshes(mesh_context):
                unchanged.append(_Prepared(fqn, module, spec, owner.binding))
                continue
            message = f"{fqn!r} already has a communication owner ({owner.spec.describe()}); unbind it first"
            raise BindingRefusedError("owner", message)
        cls = type(module)
        failure = None
        if proved_class is not cls:
            failure = class_failures(cls, spec)
        if failure is not None:
            code, message = failure
            message = f"{fqn!r} ({cls.__qualname__}) cannot be bound as {spec.describe()}: [{code}] {message}"
            raise BindingRefusedError("class", message)
        binding = ParallelBinding(mesh_binding)
        if spec.binding_kind == "cp":
            if "cp" not in cp_contexts:
                cp_contexts["cp"] = CPContext(mesh_binding.axis_mesh("cp"))
            binding = ParallelBinding(mesh_binding, cp_context=cp_contexts["cp"])
        elif spec.binding_kind == "ep":
            num_experts = spec.options["num_experts"]
            if num_experts not in ep_contexts:
                ep_contexts[num_experts] = EPContext(mesh_binding.axis_mesh("ep"), num_experts)
            binding = ParallelBinding(mesh_binding, ep_context=ep_contexts[num_experts])
        prepared.append(_Prepared(fqn, module, spec, binding))
    return prepared, unchanged


def _restore(bound: list[_Prepared]) -> list[str]:
    """Undo this call's bindings, newest first: drop the owner, call the optional
    ``unbind_parallel``. Returns the ``unbind_parallel`` calls that raised."""
    failures = []
    for entry in reversed(bound):
        entry.module.__dict__.pop(_OWNER, None)
        unbind = getattr(type(entry.module), "unbind_parallel", None)
        if callable(unbind):
            try:
                unbind(entry.module)
            except Exception as error:
                failures.append(f"{entry.fqn!r} ({type(error).__name__}: {error})")
    return failures


def validate_materialized_modules(model: nn.Module) -> None:
    """Run every recorded spec's ``validate_materialized(module=, binding=)``; raise one
    ``MaterializationError`` listing every failure."""
    records = unwrapped(model).__dict__.get(_RECORDS)
    if records is None:
        raise BindingRefusedError("unbound", "no plan is recorded on this model: call bind_parallel_modules first")
    failures: list[tuple[str, BaseException]] = []
    for record in records:
        check = record.spec.validate_materialized
        if check is None:
            continue
        try:
            returned = check(module=submodule(model, record.fqn), binding=record.binding)
            if returned is not None:
                raise ValueError(f"validate_materialized returned {returned!r}: {RAISE_TO_REJECT}")
        except Exception as error:
            failures.append((record.fqn, error))
    if failures:
        raise MaterializationError(failures)


def bound_modules(model: nn.Module) -> tuple[BoundModule, ...]:
    """The plan entries recorded on the model by ``bind_parallel_modules`` (empty before)."""
    records: tuple[BoundModule, ...] = unwrapped(model).__dict__.get(_RECORDS, ())
    return records
