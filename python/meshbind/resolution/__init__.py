"""Plan resolution: one walk, every problem collected, one ``PlanError``.

``resolve_plan`` reads as its steps, each in a file of its name that returns its
problems: the walk and one record per planned module (``candidates``), who owns each module
(``ownership``), a bound module inside another (``nesting``), the layout providers
(``providers``), overrides merged over them (``overrides``), patterns that select nothing
(``messages``), then the §5 checks of ``ValidationBatch``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from types import MappingProxyType
from typing import Any

from torch import nn

from meshbind.errors import PlanError, PlanProblem
from meshbind.family import record_family_layout
from meshbind.resolution.candidates import (
    PlanPatterns,
    by_index,
    candidates_of,
    cycle_problems,
    parameter_owners,
    selecting_owners,
    walk,
)
from meshbind.resolution.fsdp import fsdp_units
from meshbind.resolution.messages import reported_source, unmatched_problems
from meshbind.resolution.nesting import nested_problems
from meshbind.resolution.overrides import Override, checked_overrides, merge_overrides, override_hits
from meshbind.resolution.ownership import assign_requests, family_specs, join_families
from meshbind.resolution.plan import ParallelPlan
from meshbind.resolution.providers import Progress, provide_layouts
from meshbind.specs import FullyShard, LayoutContext, NativeParallelBindingRequest, PlanSource, SourcedRequests, is_int_from
from meshbind.validation.batch import ValidationBatch

__all__ = ["ParallelPlan", "PlanError", "PlanProblem", "resolve_plan"]

_COLUMNS = ("fqn", "spec", "sharding", "module", "source")
"""What validation and the plan read of every laid-out candidate."""


def resolve_plan(
    model: nn.Module | Sequence[str],
    requests: Sequence[NativeParallelBindingRequest] | PlanSource,
    context: LayoutContext,
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    param_shapes: Mapping[str, Sequence[int]] | None = None,
    progress: Progress | None = None,
    fully_shard: FullyShard | None = None,
) -> ParallelPlan:
    """Resolve and validate a plan over a module tree or, offline, a sequence of FQNs.

    ``overrides`` maps a pattern to sharding fields (``{"params": ...}``) that replace the
    provider's fields on every planned module it selects, in the mapping's order. Offline,
    ``param_shapes`` (``{"layers.0.mlp.w1": (8, 16, 32)}``) enables the shape checks, the providers
    receive ``module=None``, and the class-level rules and ``validate`` (which need a module) do
    not run; with a module, whose own parameters give the shapes, ``param_shapes`` is refused.
    ``requests`` may be a ``PlanSource`` (``from_hf_plan``): it gives the requests for ``context``,
    and what it found reading its plan joins the problems and warnings. ``progress(step, done,
    total)``, when given, hears how far the layout providers (user code, possibly slow) have come;
    a library call is silent otherwise (``meshbind check`` shows a bar after two seconds).
    ``fully_shard`` names the FSDP units (``plan.fsdp``), checked with the rest.
    Raises ``PlanError`` listing every problem.
    """
    if not isinstance(context, LayoutContext):
        raise TypeError(f"context must be a LayoutContext, got {type(context).__name__}")
    sourced = requests.requests_for(model, context) if isinstance(requests, PlanSource) else SourcedRequests(requests)
    checked = SourcedRequests(_checked_requests(sourced.requests), sourced.problems, sourced.warnings)
    shapes = _checked_param_shapes(param_shapes, model)
    if fully_shard is not None and not isinstance(fully_shard, FullyShard):
        raise TypeError(f"fully_shard must be a FullyShard, got {type(fully_shard).__name__}")
    return _resolve(model, checked, context, checked_overrides(overrides), shapes, progress, fully_shard)


def _resolve(
    model: nn.Module | Sequence[str],
    sourced: SourcedRequests,
    context: LayoutContext,
    override_items: list[Override],
    shapes: dict[str, tuple[int, ...]] | None,
    progress: Progress | None,
    fully_shard: FullyShard | None,
) -> ParallelPlan:
    """``resolve_plan`` on checked arguments."""
    requests = sourced.requests
    patterns = PlanPatterns.of(requests, override_items)
    tree, offline = walk(patterns.pattern_set, model)
    if owners := parameter_owners(model, patterns, tree):
        # Patterns naming parameters plan the modules that hold them: resolve those modules by name.
        owning = SourcedRequests(selecting_owners(requests, patterns, owners), sourced.problems, sourced.warnings)
        return _resolve(model, owning, context, override_items, shapes, progress, fully_shard)
    problems = cycle_problems(tree) + list(sourced.problems)

    ownership = assign_requests(tree, patterns, requests)
    classes = [] if offline else tree.classes()
    module_classes = [] if offline else tree.module_classes()
    families, family_problems = family_specs(classes)
    ownership.problems += family_problems
    if families:
        join_families(ownership, tree, requests, families, classes, module_classes)
    problems += ownership.problems
    candidates = candidates_of(tree, ownership.planned, ownership.request_of, requests, families, module_classes, offline)
    for candidate, others in by_index(candidates, ownership.sharing):
        candidate.shared_with = tuple(others)
    if override_items:
        for candidate, hits in by_index(candidates, override_hits(tree, patterns)):
            candidate.overrides = tuple(hits)

    unmatched, warnings = unmatched_problems(tree, patterns, requests, candidates, model)
    problems += unmatched
    problems += nested_problems(candidates, tree)
    problems += provide_layouts(candidates, requests, context, progress)
    problems += merge_overrides(candidates, override_items)
    laid_out = [candidate for candidate in candidates if candidate.sharding is not None]

    batch = ValidationBatch(context, shapes)
    fqns, specs, shardings, modules, sources = (list(map(attrgetter(field), laid_out)) for field in _COLUMNS)
    module_types = None if offline else [classes[module_classes[candidate.index]] for candidate in laid_out]
    for row, code, message in batch.check(modules, fqns, specs, shardings, module_types):
        problems.append(PlanProblem(code, fqns[row], reported_source(laid_out[row], override_items), message))
    fsdp = None
    if fully_shard is not None:
        fsdp, fsdp_problems = fsdp_units(model, fully_shard, dict(zip(fqns, shardings, strict=True)))
        problems += fsdp_problems
    if problems:
        raise PlanError(problems)
    plan = ParallelPlan(
        parallel_modules=MappingProxyType(dict(zip(fqns, specs, strict=True))),
        sharding=MappingProxyType(dict(zip(fqns, shardings, strict=True))),
        context=context,
        sources=MappingProxyType(dict(zip(fqns, sources, strict=True))),
        warnings=(*sourced.warnings, *warnings),
        fsdp=fsdp,
    )
    if families:
        for candidate in laid_out:
            if candidate.module is not None and module_classes[candidate.index] in families:
                record_family_layout(candidate.module, candidate.fqn, candidate.spec, candidate.sharding)  # type: ignore[arg-type]
    return plan


def _checked_requests(requests: object) -> list[NativeParallelBindingRequest]:
    if isinstance(requests, (str, NativeParallelBindingRequest)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of NativeParallelBindingRequest, got {type(requests).__name__}")
    for index, request in enumerate(requests):
        if not isinstance(request, NativeParallelBindingRequest):
            raise TypeError(f"requests[{index}] must be a NativeParallelBindingRequest, got {type(request).__name__}")
    return list(requests)


def _checked_param_shapes(param_shapes: object, model: object) -> dict[str, tuple[int, ...]] | None:
    """Offline shapes as tuples; a shape that is no sequence of sizes from 0 to 2**63 - 1 (what the
    Rust checks take) is named."""
    if param_shapes is None:
        return None
    if isinstance(model, nn.Module):
        raise ValueError("param_shapes is for a sequence of FQNs: a module's own parameters give their shapes")
    if not isinstance(param_shapes, Mapping):
        raise TypeError(f"param_shapes must map parameter FQNs to shapes, got {type(param_shapes).__name__}")
    shapes = {}
    for name, shape in param_shapes.items():
        if not isinstance(name, str):
            raise TypeError(f"param_shapes: the key {name!r} must be a parameter FQN str")
        if isinstance(shape, str) or not isinstance(shape, Sequence) or not all(is_int_from(size, 0) for size in shape):
            raise ValueError(f"param_shapes[{name!r}] must be a sequence of sizes from 0 to 2**63 - 1, got {shape!r}")
        shapes[name] = tuple(shape)
    return shapes
