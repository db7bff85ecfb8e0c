"""Plan resolution against the field: how long each method takes to find the modules a plan selects.

    python benches/plan_resolution.py --sizes 61x256,61x1024 --plans deep --json out.json

Every method runs on the same tree in one process, each timed as the median of ``--repeat`` runs
with the garbage collector paused, and every method that can express a plan must select exactly
the FQNs meshbind selects (the run fails otherwise). Ratios are to ``meshbind``.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import json
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from meshbind import (
    LayoutContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    PatternSet,
    resolve_plan,
)
from meshbind.examples.moe_tree import DEEP_PLAN, MOE_PLAN, FusedExperts, build_moe_tree

PLANS: dict[str, tuple[str, ...]] = {
    "deep": DEEP_PLAN,
    "shallow": ("layers.*.self_attn", "layers.*.mlp.experts", "layers.*.mlp.gate", "lm_head", "embed_tokens"),
    "moe": MOE_PLAN,
}
FUSED_EXPERT_PLANS = ("moe",)
"""Plans run on the tree whose experts are one FusedExperts module per layer."""


class NotExpressible(Exception):
    """The method cannot state this plan (a syntax it lacks)."""


def glob_to_regex(pattern: str) -> str:
    """Segment-aware translation of the glob forms Python users write (`*`, `?`, classes, braces,
    whole-segment `**`) to a Python regex; numeric ranges and `re:` have no such translation."""
    if pattern.startswith("re:") or "<" in pattern:
        raise NotExpressible(pattern)
    segments = pattern.split(".")
    out: list[str] = []
    for k, segment in enumerate(segments):
        last = k == len(segments) - 1
        if segment == "**":
            out.append(r"(?:[^.]+\.)*" if not last else r"(?:\.[^.]+)*" if out else ".*")
            if last and out[:-1]:
                out[-2] = out[-2][:-2]  # drop the dot that `.**` absorbs
            continue
        piece = re.escape(segment).replace(r"\*", "[^.]*").replace(r"\?", "[^.]")
        piece = piece.replace(r"\{", "(?:").replace(r"\}", ")").replace(",", "|")
        piece = piece.replace(r"\[!", "[^").replace(r"\[", "[").replace(r"\]", "]").replace(r"\-", "-")
        out.append(piece + ("" if last else r"\."))
    return "".join(out)


def _named_modules(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules(remove_duplicate=False)]


class RecordingStyle(ParallelStyle):
    """A ParallelStyle that only records which modules torch's plan resolution hands it."""

    def __init__(self, seen: list[nn.Module]) -> None:
        super().__init__()
        self.seen = seen

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.seen.append(module)
        return module


def torch_parallelize_module(model: nn.Module, plan: tuple[str, ...]) -> int:
    if any(p.startswith("re:") or "**" in p or "<" in p or "{" in p or "[" in p for p in plan):
        raise NotExpressible("torch plan keys are fnmatch tokens per segment")
    seen: list[nn.Module] = []
    style = RecordingStyle(seen)
    with warnings.catch_warnings(record=True):
        # A plan-key resolution needs no communication: any truthy mesh stand-in is never used.
        parallelize_module(model, object(), dict.fromkeys(plan, style))  # type: ignore[arg-type]
    return len(seen)


def fnmatch_baseline(model: nn.Module, plan: tuple[str, ...]) -> int:
    if any(p.startswith("re:") or "**" in p or "<" in p or "{" in p for p in plan):
        raise NotExpressible("fnmatch has no braces, ranges or **")
    return sum(1 for name in _named_modules(model) if any(fnmatch.fnmatchcase(name, p) for p in plan))


def regex_per_pattern(model: nn.Module, plan: tuple[str, ...]) -> int:
    compiled = [re.compile(glob_to_regex(p)) for p in plan]
    return sum(1 for name in _named_modules(model) if any(r.fullmatch(name) for r in compiled))


def one_regex(model: nn.Module, plan: tuple[str, ...]) -> int:
    combined = re.compile("|".join(f"(?:{glob_to_regex(p)})" for p in plan))
    return sum(1 for name in _named_modules(model) if combined.fullmatch(name))


def meshbind_resolution(model: nn.Module, plan: tuple[str, ...]) -> int:
    """The whole job: compile, walk and match, and check that every pattern selected something."""
    patterns = PatternSet(plan)
    tree = patterns.walk(model)
    unmatched = [p for p, count in zip(plan, tree.hit_counts(len(plan)), strict=False) if count == 0]
    if unmatched:
        raise AssertionError(f"unmatched patterns {unmatched}")
    return len(tree)


MODULE_SPEC = ParallelModuleSpec("module", stages={"forward": ()})
REPLICATED = ModuleShardingSpec(params={"weight": {"tp": Replicate()}})
NO_PARAMETERS = ModuleShardingSpec()
EXPERTS_OWNED = ModuleShardingSpec(params={name: {"ep": Shard(0)} for name in ("gate_proj", "up_proj", "down_proj")})
CONTEXT = LayoutContext({"dp": 1, "tp": 1, "ep": 8})


def _replicated(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    return REPLICATED


def _no_parameters(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    """For the blocks of the shallow plan (attention, expert lists), which own no weight directly."""
    return NO_PARAMETERS


def _experts_owned(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    return EXPERTS_OWNED


def _accept(**kwargs: Any) -> None:
    return None


def meshbind_validate(model: nn.Module, plan: tuple[str, ...]) -> int:
    """Resolution plus every validation: one request per pattern, one layout-provider call per
    planned module; a pattern selecting fused experts binds them with an ``ep`` spec."""
    first_layer = model.layers[0].mlp.experts  # type: ignore[index]
    experts = first_layer if isinstance(first_layer, FusedExperts) else None
    requests = []
    for pattern in plan:
        if experts is not None and pattern.endswith(".experts"):
            options = {"num_experts": experts.num_experts}
            stages = {"forward": ("tokens", "expert_ids")}
            spec = ParallelModuleSpec("fused_experts", "ep", stages=stages, validate=_accept, options=options)
            requests.append(NativeParallelBindingRequest((pattern,), spec, _experts_owned))
        else:
            block = pattern.rsplit(".", 1)[-1] in ("self_attn", "experts")
            requests.append(NativeParallelBindingRequest((pattern,), MODULE_SPEC, _no_parameters if block else _replicated))
    return len(resolve_plan(model, requests, CONTEXT).parallel_modules)


def rust_walk_floor(model: nn.Module, plan: tuple[str, ...]) -> int:
    """A Rust walk over every module that matches nothing: the floor of any full walk."""
    return len(PatternSet([]).walk(model, prune=False))


METHODS: dict[str, Callable[[nn.Module, tuple[str, ...]], int]] = {
    "torch_parallelize_module": torch_parallelize_module,
    "fnmatch": fnmatch_baseline,
    "regex_per_pattern": regex_per_pattern,
    "one_regex": one_regex,
    "meshbind": meshbind_resolution,
    "meshbind_validate": meshbind_validate,
    "rust_walk_floor": rust_walk_floor,
}
PYTHON_BASELINES = ("torch_parallelize_module", "fnmatch", "regex_per_pattern", "one_regex")
COUNTED = ("fnmatch", "regex_per_pattern", "one_regex", "meshbind", "meshbind_validate", "torch_parallelize_module")


@dataclass
class Row:
    tree: str
    modules: int
    plan: str
    method: str
    median_s: float | None
    matches: int | None


def time_method(fn: Callable[[], int], repeat: int) -> tuple[float, int]:
    times, result = [], 0
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return statistics.median(times), result


def run(sizes: list[tuple[int, int]], plans: list[str], repeat: int) -> list[Row]:
    rows: list[Row] = []
    for layers, experts in sizes:
        trees: dict[bool, nn.Module] = {}
        for plan_name in plans:
            fused = plan_name in FUSED_EXPERT_PLANS
            if fused not in trees:
                print(f"building {layers}x{experts}{' (fused experts)' if fused else ''} ...", file=sys.stderr)
                trees[fused] = build_moe_tree(layers, experts, fused_experts=fused)
            model = trees[fused]
            modules = sum(1 for _ in model.modules())
            plan = PLANS[plan_name]
            counts: dict[str, int] = {}
            for method, fn in METHODS.items():
                try:
                    median, matches = time_method(lambda fn=fn, model=model, plan=plan: fn(model, plan), repeat)
                except NotExpressible:
                    rows.append(Row(f"{layers}x{experts}", modules, plan_name, method, None, None))
                    continue
                if method in COUNTED:
                    counts[method] = matches
                rows.append(
                    Row(f"{layers}x{experts}", modules, plan_name, method, median, matches if method in COUNTED else None)
                )
                print(f"  {plan_name:<8} {method:<26} {median:9.4f} s", file=sys.stderr)
            # torch hands each selected module once; the others count FQNs (the same on this tree).
            if len(set(counts.values())) > 1:
                raise AssertionError(f"match counts differ on {layers}x{experts} {plan_name}: {counts}")
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"{'tree':<9} {'modules':>8} {'plan':<8} {'method':<26} {'median s':>10} {'matches':>8} {'x meshbind':>11}")
    for row in rows:
        reference = next(r.median_s for r in rows if (r.tree, r.plan, r.method) == (row.tree, row.plan, "meshbind"))
        if row.median_s is None:
            print(f"{row.tree:<9} {row.modules:>8} {row.plan:<8} {row.method:<26} {'n/a':>10}")
            continue
        ratio = row.median_s / reference if reference else float("nan")
        matches = "" if row.matches is None else row.matches
        print(f"{row.tree:<9} {row.modules:>8} {row.plan:<8} {row.method:<26} {row.median_s:>10.4f} {matches:>8} {ratio:>10.2f}x")
    for tree in dict.fromkeys(r.tree for r in rows):
        for plan in dict.fromkeys(r.plan for r in rows):
            group = {r.method: r.median_s for r in rows if (r.tree, r.plan) == (tree, plan)}
            best = min((group[m] for m in PYTHON_BASELINES if group.get(m) is not None), default=None)
            ours, floor = group.get("meshbind"), group.get("rust_walk_floor")
            if best and ours and floor:
                print(
                    f"{tree} {plan}: fastest Python baseline / meshbind = {best / ours:.1f}x; "
                    f"meshbind / rust_walk_floor = {ours / floor:.2f}x"
                )


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for item in text.split(","):
        layers, _, experts = item.partition("x")
        if not (layers.isdigit() and experts.isdigit()):
            raise argparse.ArgumentTypeError(f"size {item!r} is not of the form LAYERSxEXPERTS")
        sizes.append((int(layers), int(experts)))
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("8x16,61x256"))
    parser.add_argument("--plans", default="deep", help=f"comma-separated, of {sorted(PLANS)}")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    plans = args.plans.split(",")
    unknown = [p for p in plans if p not in PLANS]
    if unknown:
        parser.error(f"unknown plans {unknown}; known: {sorted(PLANS)}")
    if args.repeat < 5:
        parser.error("--repeat must be at least 5 (medians of fewer runs are noise)")
    rows = run(args.sizes, plans, args.repeat)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [row.__dict__ for row in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
