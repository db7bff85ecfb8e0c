"""How close `meshbind_validate` can come to `meshbind`: the least Python work any resolution must
add to the match (`validation_floor` below), timed side by side with both.

    python benches/validation_floor.py --size 61x1024 --plan moe

Whatever does the rest of resolution and validation (Rust or Python), `meshbind_validate` cannot be
faster than `validation_floor`, so `validation_floor / meshbind` bounds the ratio the `moe` bar asks
of it. `required_calls_floor` is the bound for any resolution at all: the match and the user code
SPEC makes it call, nothing else, with the requests built before the clock starts.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import cast

import resolution_methods
from resolution_methods import (
    FUSED_EXPERT_PLANS,
    PLANS,
    Size,
    meshbind_resolution,
    meshbind_validate,
    validation_requests,
)
from torch import nn

from meshbind import ModuleShardingSpec, NativeParallelBindingRequest, PatternSet
from meshbind.examples.moe_tree import build_moe_tree


def validation_floor(target: nn.Module, plan: tuple[str, ...]) -> resolution_methods.Outcome:
    """The least Python work any resolution must add to meshbind's match (SPEC §3-§5): one
    layout-provider call per planned module; for each ``ep`` module, the ``shape[0]`` of its
    ``Shard`` parameters and its spec's ``validate``; the plan's FQN → spec / sharding / source
    mappings. No check, no report, no class rule: ``meshbind_validate`` cannot beat it."""
    requests = resolution_methods.validation_requests(target, plan)
    noticed, fqns, request_of, shardings = _match_and_required_calls(target, plan, requests)
    specs = [requests[r].parallel for r in request_of]
    sources = [f"requests[{r}]" for r in request_of]
    plan_mappings = [MappingProxyType(dict(zip(fqns, values, strict=True))) for values in (specs, shardings, sources)]
    return resolution_methods.Outcome(len(plan_mappings[0]), noticed)


def required_calls_floor(
    target: nn.Module, plan: tuple[str, ...], requests: Sequence[NativeParallelBindingRequest]
) -> resolution_methods.Outcome:
    """Tighter than ``validation_floor``: its match and user calls alone, with the requests built
    beforehand and no plan built. Any resolution costs at least this."""
    noticed, fqns, _, _ = _match_and_required_calls(target, plan, requests)
    return resolution_methods.Outcome(len(fqns), noticed)


def _match_and_required_calls(
    target: nn.Module, plan: tuple[str, ...], requests: Sequence[NativeParallelBindingRequest]
) -> tuple[bool, list[str], list[int], list[ModuleShardingSpec]]:
    """meshbind's match, then the user code SPEC makes every resolution run: each provider, and each
    ``ep`` module's ``shape[0]`` reads and ``validate``. Whether a pattern selected nothing, and
    each planned FQN with its request and layout."""
    index = PatternSet(plan).walk(target, prune=True, modules=True)
    noticed = 0 in index.hit_counts()
    selected = index.selected(list(range(len(plan))), [])
    fqns, modules, request_of = selected.fqns, cast(list[nn.Module], selected.modules), cast(list[int], selected.first_request)
    shardings = []
    for r, module, fqn in zip(request_of, modules, fqns, strict=True):
        sharding = requests[r].sharding(module, fqn, resolution_methods.CONTEXT)
        spec = requests[r].parallel
        if spec.binding_kind == "ep" and spec.validate is not None:
            parameters = module._parameters
            [parameters[path].shape[0] for path, placements in sharding.params.items() if "ep" in placements]  # type: ignore[union-attr]
            spec.validate(module=module, sharding=sharding, context=resolution_methods.CONTEXT)
        shardings.append(sharding)
    return noticed, fqns, request_of, shardings


def _timed_in_turn(
    runs: dict[str, Callable[[], resolution_methods.Outcome]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, resolution_methods.Outcome]]:
    """Each method's time in each round, every method once a round, each run after a
    ``gc.collect()`` with the collector paused: a burst of load on a shared machine falls on
    every method alike rather than on whichever ran then."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    outcomes = {}
    for _ in range(rounds):
        for name, run in runs.items():
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                outcomes[name] = run()
                times[name].append(time.perf_counter() - start)
            finally:
                gc.enable()
    return times, outcomes


def _paired_ratio(times: list[float], baseline: list[float]) -> float:
    """The median of the ratios of one round's times."""
    return statistics.median(t / b for t, b in zip(times, baseline, strict=True))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="61x1024", type=Size.parse)
    parser.add_argument("--plan", default="moe", choices=sorted(PLANS))
    parser.add_argument("--repeat", type=int, default=50, help="rounds, each running every method once")
    args = parser.parse_args(argv)
    tree = build_moe_tree(args.size.layers, args.size.experts, fused_experts=args.plan in FUSED_EXPERT_PLANS)
    plan = PLANS[args.plan](args.size.layers)
    requests = validation_requests(tree, plan)
    runs = {
        "meshbind": functools.partial(meshbind_resolution, tree, plan),
        "required_calls_floor": functools.partial(required_calls_floor, tree, plan, requests),
        "validation_floor": functools.partial(validation_floor, tree, plan),
        "meshbind_validate": functools.partial(meshbind_validate, tree, plan),
    }
    times, outcomes = _timed_in_turn(runs, args.repeat)
    for name, median in {name: statistics.median(column) for name, column in times.items()}.items():
        print(f"{args.size.label} {args.plan}  {name:<20} {median * 1e3:9.3f} ms  {outcomes[name].matches} planned modules")
    for name in list(runs)[1:]:
        print(f"{name} / meshbind = {_paired_ratio(times[name], times['meshbind']):.2f}x")
    print(f"meshbind_validate / validation_floor = {_paired_ratio(times['meshbind_validate'], times['validation_floor']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
