"""The layout providers: each planned module's ``ModuleShardingSpec``, from its
request's ``sharding`` callable or its family class's ``parallel_sharding``.

A provider that raises or returns something else is a ``layout`` problem of that module. Requests
with equal specs share a module only when their providers give it one layout: otherwise which one
binds it would depend on the order of the requests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from torch import nn

from meshbind.errors import LayoutRefusal, PlanProblem, ProblemCode
from meshbind.placements import placements_text
from meshbind.resolution.selection import PlannedModules
from meshbind.specs import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest

Provider = Callable[[nn.Module | None, str, LayoutContext], ModuleShardingSpec]
Progress = Callable[[str, int, int], None]
"""``progress(step, done, total)``: how far a slow step of resolution has come."""


def family_sharding(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    """A family member's layout provider: its own ``parallel_sharding``."""
    provider = getattr(type(module), "parallel_sharding", None)
    if provider is None:
        raise TypeError(f"family class {type(module).__qualname__} defines no parallel_sharding(fqn, context)")
    result: ModuleShardingSpec = provider(module, fqn, context)
    return result


def provide_layouts(
    planned: PlannedModules,
    requests: Sequence[NativeParallelBindingRequest],
    context: LayoutContext,
    progress: Progress | None,
) -> list[PlanProblem]:
    """Sets every module's sharding from its provider (``None`` after a problem), then drops
    the sharding of a module whose sharing requests' providers disagree. The providers are user
    code, possibly slow: ``progress`` hears of each call."""
    providers: list[Provider] = [request.sharding for request in requests]
    problems: list[PlanProblem] = []
    shardings = planned.shardings
    total = len(shardings)
    for row, (request, module, fqn) in enumerate(zip(planned.requests, planned.modules, planned.fqns, strict=True)):
        provider = family_sharding if request is None else providers[request]
        try:
            sharding = provider(module, fqn, context)
        except Exception as error:
            problems.append(_refusal(error, fqn, planned.sources[row]))
        else:
            if isinstance(sharding, ModuleShardingSpec):
                shardings[row] = sharding
            else:
                problems.append(_refusal(sharding, fqn, planned.sources[row]))
        if progress is not None:
            progress("layout providers", row + 1, total)
    if planned.other_requests:
        problems += _check_shared_layouts(planned, providers, requests, context)
    return problems


def _refusal(result: object, fqn: str, source: str) -> PlanProblem:
    """The ``layout`` problem of a provider that raised ``result`` or returned it (no sharding)."""
    if isinstance(result, LayoutRefusal):
        message = str(result)
    elif isinstance(result, Exception):
        message = f"the layout provider raised {type(result).__name__}: {result}"
    else:
        message = f"the layout provider returned {type(result).__name__}, not a ModuleShardingSpec"
    return PlanProblem(ProblemCode.LAYOUT, fqn, source, message)


def _check_shared_layouts(
    planned: PlannedModules,
    providers: Sequence[Provider],
    requests: Sequence[NativeParallelBindingRequest],
    context: LayoutContext,
) -> list[PlanProblem]:
    """Every other sharing provider is called in one batch; a module whose layouts differ is a
    conflict and loses its sharding."""
    problems: list[PlanProblem] = []
    shared: list[tuple[int, int]] = []
    for index, others in planned.other_requests.items():
        row = planned.row(index)
        if planned.shardings[row] is not None:
            shared += [(row, other) for other in others]
    theirs = [_provided(providers[other], planned, row, f"requests[{other}]", context, problems) for row, other in shared]
    for (row, other), layout in zip(shared, theirs, strict=True):
        ours = planned.shardings[row]
        if ours is None or layout is ours or layout == ours:  # dropped by an earlier pair, or agreeing
            continue
        planned.shardings[row] = None
        if layout is None:  # that provider failed: its layout problem is reported
            continue
        mine, differing = _field_texts(ours), _field_texts(layout)
        fields = "; ".join(f"{key} {mine[key]} against {differing[key]}" for key in mine if mine[key] != differing[key])
        first = cast(int, planned.requests[row])  # a shared module is a request's
        message = (
            f"selected by requests[{first}] and requests[{other}] with equal specs "
            f"({requests[first].parallel.describe()}) but different layouts: {fields}"
        )
        problems.append(PlanProblem(ProblemCode.CONFLICT, planned.fqns[row], f"requests[{first}], requests[{other}]", message))
    return problems


def _provided(
    provider: Provider, planned: PlannedModules, row: int, source: str, context: LayoutContext, problems: list[PlanProblem]
) -> ModuleShardingSpec | None:
    """A module's layout from ``provider``; ``None`` after a problem (named for ``source``)."""
    fqn = planned.fqns[row]
    try:
        sharding = provider(planned.modules[row], fqn, context)
    except Exception as error:
        problems.append(_refusal(error, fqn, source))
        return None
    if not isinstance(sharding, ModuleShardingSpec):
        problems.append(_refusal(sharding, fqn, source))
        return None
    return sharding


def _field_texts(sharding: ModuleShardingSpec) -> dict[str, str]:
    """Each field of a sharding as messages show it."""
    texts = {"params": "{" + ", ".join(f"{path}: {placements_text(p)}" for path, p in sharding.params.items()) + "}"}
    texts |= {field: placements_text(getattr(sharding, field)) for field in ("in_src", "in_dst", "out_src")}
    texts["out_dst"] = "None" if sharding.out_dst is None else placements_text(sharding.out_dst)
    texts["expert_stack"] = str(sharding.expert_stack)
    return texts
