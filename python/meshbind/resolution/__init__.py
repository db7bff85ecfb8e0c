"""Plan resolution: one walk, every problem collected, one ``PlanError``.

``resolve_plan`` reads as its steps, each in a file of its name that reads and extends the planned
modules (``selection.PlannedModules``: one row per module, in columns) and returns its problems:
the walk and the planned modules (``selection``), who owns each module (``ownership``), family
members joining (``families``), patterns that select nothing (``unmatched``), a bound module
inside another (``nesting``), the layout providers (``providers``), overrides merged over them
(``overrides``), the per-module rules (``validate``), the FSDP units (``fsdp``), and the plan
(``plan``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from meshbind._core import ModuleTree
from meshbind.errors import PlanError, PlanProblem
from meshbind.family import record_family_layout
from meshbind.fsdp_request import FullyShard
from meshbind.model_index import ModelIndex, walk_whole
from meshbind.resolution.families import join_families
from meshbind.resolution.fsdp import FSDPPlan, default_fully_shard, fsdp_units
from meshbind.resolution.nesting import nested_problems
from meshbind.resolution.overrides import checked_overrides, merge_overrides
from meshbind.resolution.ownership import own_modules
from meshbind.resolution.plan import ParallelPlan, build_plan
from meshbind.resolution.providers import Progress, provide_layouts
from meshbind.resolution.selection import Override, Selection, select_modules
from meshbind.resolution.unmatched import unmatched_problems
from meshbind.resolution.validate import validation_problems
from meshbind.specs import LayoutContext, NativeParallelBindingRequest, PlanSource, SourcedRequests
from meshbind.units import is_int_from

__all__ = ["ParallelPlan", "PlanError", "PlanProblem", "resolve_plan"]


def resolve_plan(
    model: nn.Module | Sequence[str],
    requests: Sequence[NativeParallelBindingRequest] | PlanSource,
    context: LayoutContext,
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    param_shapes: Mapping[str, Sequence[int]] | None = None,
    progress: Progress | None = None,
    fully_shard: FullyShard | None = None,
    index: bool = False,
) -> ParallelPlan:
    """Resolve and validate a plan over a module tree or, offline, a sequence of FQNs.

    ``overrides`` maps a pattern to sharding fields (``{"params": ...}``) that replace the
    provider's fields on every planned module it selects, in the mapping's order. Offline,
    ``param_shapes`` (``{"layers.0.mlp.w1": (8, 16, 32)}``) enables the shape checks, the providers
    receive ``module=None``, and the class-level rules and ``validate`` (which need a module) do
    not run; with a module, whose own parameters give the shapes, ``param_shapes`` is refused.
    ``requests`` may be a ``PlanSource`` (``from_hf_plan``): it gives the requests for ``context``,
    and what it found reading its plan joins the problems and warnings. ``progress(step, done,
    total)``, when given, hears when the walk is done (``"walk"``), how far the layout providers
    (user code, possibly slow) have come (``"layout providers"``) and when validation starts and
    ends (``"validation"``, 0 then 1 of 1); a library call is silent otherwise (``meshbind check``
    shows a bar after two seconds, ``meshbind bench`` tells the phases apart).
    ``fully_shard`` names the FSDP units (``plan.fsdp``) and their mixed precision, checked with
    the rest. With none named (``fully_shard=None`` and ``dp_shard`` above 1, or ``FullyShard(None)``),
    the units are torchtitan's defaults (each block of the model's layer list,
    each module holding parameters placed on ``ep``, then the root; ``plan.fsdp.by_default``).
    ``index``: walk the whole tree once, parameters included, and keep what it found on the plan
    (``plan.index``) for the report, the ranks' agreement and step memory to read instead of
    walking the model again; FSDP units need the index and build it whether asked or not. A plan
    source (``from_hf_plan``) reads the same one whole walk, index or not. A pruned walk (the
    default otherwise) enters only the subtrees a pattern can reach. Raises ``PlanError`` listing
    every problem.
    """
    if not isinstance(context, LayoutContext):
        raise TypeError(f"context must be a LayoutContext, got {type(context).__name__}")
    shapes = _checked_param_shapes(param_shapes, model)
    if fully_shard is not None and not isinstance(fully_shard, FullyShard):
        raise TypeError(f"fully_shard must be a FullyShard, got {type(fully_shard).__name__}")
    if not isinstance(index, bool):
        raise TypeError(f"index must be a bool, got {type(index).__name__}")
    override_rules = checked_overrides(overrides)
    # dp_shard shards, as in torchtitan; FullyShard(None) asks for the default units outright.
    by_default = context.world.dp_shard > 1 if fully_shard is None else fully_shard.units is None
    indexed = index or fully_shard is not None or by_default
    selection, sourced, model_index = _select(model, requests, context, override_rules, indexed)
    return _resolve(model, selection, sourced, context, override_rules, shapes, progress, fully_shard, by_default, model_index)


def _select(
    model: nn.Module | Sequence[str],
    requests: Sequence[NativeParallelBindingRequest] | PlanSource,
    context: LayoutContext,
    overrides: list[Override],
    indexed: bool,
) -> tuple[Selection, SourcedRequests, ModelIndex | None]:
    """The selection, the requests it selected for, and the model index when ``indexed`` (a module
    tree only). A module tree that is indexed or read by a plan source is walked whole once, and
    the source, the selection and the index all read that walk."""
    source = requests if isinstance(requests, PlanSource) else None
    whole: ModuleTree | None = None
    model_index: ModelIndex | None = None
    if isinstance(model, nn.Module) and (indexed or source is not None):
        whole = walk_whole(model)
        model_index = ModelIndex.of_tree(model, whole) if indexed else None
    if source is not None:
        read = whole if whole is not None else model
        assert not isinstance(read, nn.Module)  # a module tree is walked whole for its source
        sourced = source.requests_for(read, context)
    else:
        sourced = SourcedRequests(requests)  # type: ignore[arg-type]
    checked = SourcedRequests(_checked_requests(sourced.requests), sourced.problems, sourced.warnings)
    return select_modules(model, checked.requests, overrides, whole=whole), checked, model_index


def _resolve(
    model: nn.Module | Sequence[str],
    selection: Selection,
    sourced: SourcedRequests,
    context: LayoutContext,
    overrides: list[Override],
    shapes: dict[str, tuple[int, ...]] | None,
    progress: Progress | None,
    fully_shard: FullyShard | None,
    by_default: bool,
    index: ModelIndex | None,
) -> ParallelPlan:
    """``resolve_plan`` after the walk, on checked arguments."""
    phase_done = progress or _silent  # the providers' loop hears nothing unless a caller asked
    wants_fsdp = fully_shard is not None or by_default
    phase_done("walk", 1, 1)
    planned = selection.planned
    problems = [*selection.problems, *sourced.problems]
    problems += own_modules(planned, selection.requests)
    family_members, found = join_families(selection)
    problems += found
    unmatched, warnings = unmatched_problems(selection, model, index)
    problems += unmatched
    problems += nested_problems(planned, selection.tree)
    problems += provide_layouts(planned, selection.requests, context, progress)
    problems += merge_overrides(planned, overrides)
    laid_out = planned.laid_out()
    phase_done("validation", 0, 1)
    problems += validation_problems(laid_out, context, shapes, overrides, selection.offline)
    phase_done("validation", 1, 1)
    fsdp: FSDPPlan | None = None
    if wants_fsdp:
        layouts = dict(zip(laid_out.fqns, laid_out.shardings, strict=True))
        indexed = index if index is not None else model  # offline: the FQNs
        request = fully_shard or FullyShard(None)
        if by_default:  # the default units, with the request's options
            request = replace(request, units=default_fully_shard(indexed, layouts).units)  # type: ignore[arg-type]
        fsdp, found = fsdp_units(indexed, request, layouts, by_default=by_default)  # type: ignore[arg-type]
        problems += found
    if problems:
        raise PlanError(problems)
    plan = build_plan(laid_out, context, (*sourced.warnings, *warnings), fsdp, selection.offline, index)
    if family_members:
        for tree_index, module, fqn, spec, sharding in zip(
            laid_out.indices, laid_out.modules, laid_out.fqns, laid_out.specs, laid_out.shardings, strict=True
        ):
            if tree_index in family_members:
                record_family_layout(module, fqn, spec, sharding)  # type: ignore[arg-type]
    return plan


def _silent(step: str, done: int, total: int) -> None:
    """The progress of a call that asked to hear none."""


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
