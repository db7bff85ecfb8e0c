"""Plan resolution against the baselines, side by side: the methods, the plans, the sizes, the
timing, the table and the plot that ``plan_resolution.py`` and ``validation_floor.py`` share.

Every method runs on the same tree (or flat FQN list) in one process, each timed as the median of
at least ``--repeat`` runs with the garbage collector paused (a fast method runs on until
``MIN_TIMED_SECONDS`` have passed; one whose first run takes over ``SLOW_SECONDS`` runs once), and
every method that can express a plan must select exactly what meshbind selects (the run fails
otherwise); ``n/a`` marks a plan a method cannot state. Ratios are to ``meshbind``. Each size runs
in a fresh worker process, all its methods side by side there, so no size's numbers depend on
which sizes ran before it (objects built after a freed 61x1024 tree lie scattered through its
memory).
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import gc
import json
import multiprocessing
import os
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from meshbind._core import PatternSet
from meshbind.errors import PlanError
from meshbind.examples.moe_tree import DEEP_PLAN, MOE_PLAN, FusedExperts, build_moe_tree, moe_tree_fqns
from meshbind.resolution import resolve_plan
from meshbind.specs import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec

SLOW_SECONDS = 3.0
MIN_TIMED_SECONDS = 0.5
"""A method taking milliseconds runs on until this much time has passed (its collections
included): the median of five such runs moves with one slow run (a first call, or a call whose
second thread found the VM's other core taken)."""
MAX_RUNS = 100
TYPO = "layers.*.mlp.experts.*.gate_prj"

Target = nn.Module | list[str]
"""A module tree, or a flat list of FQNs (the offline form)."""


def _per_layer(layers: int) -> tuple[str, ...]:
    """The deep plan written out once per layer, as generated plans look."""
    per_layer = [p for p in DEEP_PLAN if p.startswith("layers.*.")]
    ends = [p for p in DEEP_PLAN if not p.startswith("layers.*.")]
    return tuple(p.replace("layers.*.", f"layers.{layer}.", 1) for layer in range(layers) for p in per_layer) + tuple(ends)


PLANS: dict[str, Callable[[int], tuple[str, ...]]] = {
    "deep": lambda layers: DEEP_PLAN,
    "shallow": lambda layers: ("layers.*.self_attn", "layers.*.mlp.experts", "layers.*.mlp.gate", "lm_head", "embed_tokens"),
    "per_layer": _per_layer,
    "globstar": lambda layers: ("**.down_proj", "**.experts.<0-127>.up_proj", "layers.**.q_proj", "**.mlp.gate", "embed_tokens"),
    "typo": lambda layers: (*DEEP_PLAN, TYPO),
    "moe": lambda layers: MOE_PLAN,
}
FUSED_EXPERT_PLANS = ("moe",)
"""Plans run on the tree whose experts are one FusedExperts module per layer."""


class NotExpressible(Exception):
    """The method cannot state this plan (a syntax it lacks) or run on this target."""


MAX_PER_PATTERN_CHECKS = 50_000_000
"""A method that tries every pattern on every name is skipped past this many (pattern, name)
pairs (490 patterns over a million names would take minutes); the table says ``skip``."""


class TooSlow(Exception):
    """The method would take minutes here: skipped, and said so."""


def _per_pattern_budget(target: Target, plan: tuple[str, ...]) -> None:
    names = len(target) if isinstance(target, list) else None
    if names is not None and names * len(plan) > MAX_PER_PATTERN_CHECKS:
        raise TooSlow(f"{len(plan)} patterns x {names} names")


@dataclass(frozen=True)
class Outcome:
    matches: int | None
    """What was selected (``None``: the method gave no selection, as when it rejects the plan)."""
    noticed: bool
    """Whether the method reported a pattern that selects nothing."""


# --- the baselines -------------------------------------------------------------------------------


def glob_to_regex(pattern: str) -> str:
    """Segment-aware translation of the glob forms Python users write (``*``, ``?``, classes,
    braces, whole-segment ``**``, numeric ranges as alternations) to a Python regex."""
    if pattern.startswith("re:"):
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
        piece = re.sub(r"<(\d+)-(\d+)>", lambda m: "(?:" + "|".join(map(str, range(int(m[1]), int(m[2]) + 1))) + ")", piece)
        out.append(piece + ("" if last else r"\."))
    return "".join(out)


def _names(target: Target) -> list[str]:
    if isinstance(target, list):
        return target
    return [name for name, _ in target.named_modules(remove_duplicate=False)]


class RecordingStyle(ParallelStyle):
    """A ParallelStyle that only records which modules torch's plan resolution hands it."""

    def __init__(self, seen: list[nn.Module]) -> None:
        super().__init__()
        self.seen = seen

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.seen.append(module)
        return module


def torch_parallelize_module(target: Target, plan: tuple[str, ...]) -> Outcome:
    if isinstance(target, list):
        raise NotExpressible("parallelize_module needs a module tree")
    if any(p.startswith("re:") or "**" in p or "<" in p or "{" in p or "[" in p for p in plan):
        raise NotExpressible("torch plan keys are fnmatch tokens per segment")
    seen: list[nn.Module] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # A plan-key resolution needs no communication: any truthy mesh stand-in is never used.
        parallelize_module(target, object(), dict.fromkeys(plan, RecordingStyle(seen)))  # type: ignore[arg-type]
    noticed = any("could not be resolved" in str(w.message) for w in caught)
    return Outcome(len(seen), noticed)


def fnmatch_baseline(target: Target, plan: tuple[str, ...]) -> Outcome:
    """named_modules() + fnmatchcase, as Hugging Face tp_plan and compressed-tensors match."""
    if any(p.startswith("re:") or "**" in p or "<" in p or "{" in p for p in plan):
        raise NotExpressible("fnmatch has no braces, ranges or **")
    _per_pattern_budget(target, plan)
    return Outcome(sum(1 for name in _names(target) if any(fnmatch.fnmatchcase(name, p) for p in plan)), False)


def regex_per_pattern(target: Target, plan: tuple[str, ...]) -> Outcome:
    """One re.fullmatch per key per module (veScale)."""
    compiled = [re.compile(glob_to_regex(p)) for p in plan]
    _per_pattern_budget(target, plan)
    return Outcome(sum(1 for name in _names(target) if any(r.fullmatch(name) for r in compiled)), False)


def one_regex(target: Target, plan: tuple[str, ...]) -> Outcome:
    """named_modules() + one alternation regex: the best pure Python."""
    combined = re.compile("|".join(f"(?:{glob_to_regex(p)})" for p in plan))
    return Outcome(sum(1 for name in _names(target) if combined.fullmatch(name)), False)


# --- meshbind ------------------------------------------------------------------------------------


def meshbind_resolution(target: Target, plan: tuple[str, ...]) -> Outcome:
    """Compile, walk the tree (or match the FQN list, answered as flat index arrays) and match;
    report patterns that select nothing."""
    patterns = PatternSet(plan)
    if isinstance(target, list):
        found = patterns.match_indices(target)
        return Outcome(found.matched_names(), 0 in found.counts)
    tree = patterns.walk(target)
    return Outcome(tree.matched_names(), 0 in tree.hit_counts())


MODULE_SPEC = ParallelModuleSpec("module", stages={"forward": ()})
REPLICATED = ModuleShardingSpec(params={"weight": {"tp": Replicate()}})
NO_PARAMETERS = ModuleShardingSpec()
EXPERTS_OWNED = ModuleShardingSpec(params={name: {"ep": Shard(0)} for name in ("gate_proj", "up_proj", "down_proj")})
# cp lends ep its ranks: at dp_shard above 1 resolution would also choose FSDP units, which these
# methods do not time.
CONTEXT = LayoutContext({"cp": 8, "tp": 1, "ep": 8})


def _replicated(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    return REPLICATED


def _no_parameters(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    """For the blocks of the shallow plan (attention, expert lists), which own no weight directly."""
    return NO_PARAMETERS


def _experts_owned(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    return EXPERTS_OWNED


def _accept(**kwargs: Any) -> None:
    return None


def validation_requests(target: Target, plan: tuple[str, ...]) -> list[NativeParallelBindingRequest]:
    """One request per pattern; a pattern selecting fused experts binds them with an ``ep`` spec."""
    experts = None if isinstance(target, list) else target.get_submodule("layers.0.mlp.experts")
    requests = []
    for pattern in plan:
        if isinstance(experts, FusedExperts) and pattern.endswith(".experts"):
            options = {"num_experts": experts.num_experts}
            stages = {"forward": ("tokens", "expert_ids")}
            spec = ParallelModuleSpec("fused_experts", "ep", stages=stages, validate=_accept, options=options)
            requests.append(NativeParallelBindingRequest((pattern,), spec, _experts_owned))
        else:
            block = pattern.rsplit(".", 1)[-1] in ("self_attn", "experts")
            requests.append(NativeParallelBindingRequest((pattern,), MODULE_SPEC, _no_parameters if block else _replicated))
    return requests


def meshbind_validate(target: Target, plan: tuple[str, ...]) -> Outcome:
    """Resolution plus every validation: one layout-provider call per planned module."""
    try:
        return Outcome(len(resolve_plan(target, validation_requests(target, plan), CONTEXT).parallel_modules), False)
    except PlanError as error:
        if not any(problem.code == "unmatched" for problem in error.problems):
            raise
        return Outcome(None, True)


Method = Callable[[Target, tuple[str, ...]], Outcome]
METHODS: dict[str, Method] = {
    "torch_parallelize_module": torch_parallelize_module,
    "fnmatch": fnmatch_baseline,
    "regex_per_pattern": regex_per_pattern,
    "one_regex": one_regex,
    "meshbind": meshbind_resolution,
    "meshbind_validate": meshbind_validate,
}
PYTHON_BASELINES = ("torch_parallelize_module", "fnmatch", "regex_per_pattern", "one_regex")
UNCOUNTED = ("rust_walk_floor",)
"""Methods whose count is not a selection (``benches/``' floor counts every FQN it walked)."""


# --- running -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    label: str
    layers: int
    experts: int
    flat: bool

    @staticmethod
    def parse(text: str) -> Size:
        """``LxE`` (a module tree) or ``1M`` (about a million FQNs as a flat list, no tree)."""
        if text == "1M":
            return Size("1M", 61, 4096, True)
        layers, _, experts = text.partition("x")
        if not (layers.isdigit() and experts.isdigit() and int(layers) >= 1 and int(experts) >= 1):
            raise argparse.ArgumentTypeError(f"size {text!r} is neither LAYERSxEXPERTS (each at least 1) nor 1M")
        return Size(text, int(layers), int(experts), False)

    @staticmethod
    def parse_list(text: str) -> list[Size]:
        """Comma-separated sizes."""
        return [Size.parse(size) for size in text.split(",")]


@dataclass
class Row:
    tree: str
    """The size label: ``LxE`` for a module tree, ``1M`` for the flat FQN list."""
    modules: int
    plan: str
    method: str
    median_s: float | None
    runs: int
    matches: int | None
    noticed: bool | None
    skipped: bool = False


def time_method(fn: Callable[[], Outcome], repeat: int) -> tuple[float, int, Outcome]:
    """The median time of ``fn`` over at least ``repeat`` runs, each after a ``gc.collect()``, and
    more runs while less than ``MIN_TIMED_SECONDS`` have passed (at most ``MAX_RUNS``); one run
    when the first is slow."""
    times: list[float] = []
    outcome = Outcome(None, False)
    began = time.perf_counter()
    while len(times) < repeat or (time.perf_counter() - began < MIN_TIMED_SECONDS and len(times) < MAX_RUNS):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            outcome = fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
        if times[0] > SLOW_SECONDS:
            break
    return statistics.median(times), len(times), outcome


def _target(size: Size, fused: bool) -> Target:
    if size.flat:
        return moe_tree_fqns(size.layers, size.experts)
    return build_moe_tree(size.layers, size.experts, fused_experts=fused)


def run(
    sizes: Sequence[Size], plans: Sequence[str], repeat: int, methods: Mapping[str, Method] = MappingProxyType(METHODS)
) -> list[Row]:
    rows: list[Row] = []
    for size in sizes:
        targets: dict[bool, tuple[Target, int]] = {}
        for plan_name in plans:
            fused = plan_name in FUSED_EXPERT_PLANS
            if fused and size.flat:
                continue
            if fused not in targets:
                what = "FQNs" if size.flat else "tree" + (" with fused experts" if fused else "")
                print(f"building {size.label} {what} ...", file=sys.stderr, flush=True)
                built = _target(size, fused)
                targets[fused] = built, len(built) if isinstance(built, list) else sum(1 for _ in built.modules())
            target, modules = targets[fused]
            plan = PLANS[plan_name](size.layers)
            counts: dict[str, int] = {}
            for method, call in methods.items():
                try:
                    median, runs, outcome = time_method(functools.partial(call, target, plan), repeat)
                except (NotExpressible, TooSlow) as reason:
                    rows.append(Row(size.label, modules, plan_name, method, None, 0, None, None, isinstance(reason, TooSlow)))
                    continue
                if outcome.matches is not None and method not in UNCOUNTED:
                    counts[method] = outcome.matches
                noticed = None if method in UNCOUNTED else outcome.noticed
                rows.append(Row(size.label, modules, plan_name, method, median, runs, outcome.matches, noticed))
                print(f"  {size.label:<8} {plan_name:<10} {method:<26} {median:9.4f} s", file=sys.stderr, flush=True)
            if len(set(counts.values())) > 1:
                raise AssertionError(f"match counts differ on {size.label} {plan_name}: {counts}")
    return rows


def run_each_size_apart(sizes: Sequence[Size], plans: Sequence[str], repeat: int, methods: Mapping[str, Method]) -> list[Row]:
    """``run`` for each size in a fresh worker process, one after another."""
    rows: list[Row] = []
    for size in sizes:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as worker:
            rows += worker.submit(run, [size], plans, repeat, methods).result()
    return rows


def _reference(rows: Sequence[Row], row: Row, method: str = "meshbind") -> float | None:
    return next((r.median_s for r in rows if (r.tree, r.plan, r.method) == (row.tree, row.plan, method)), None)


def summary(rows: Sequence[Row]) -> list[str]:
    """The ratios the issues name, one line each."""
    lines = []
    groups = dict.fromkeys((r.tree, r.plan) for r in rows)
    for size, plan in groups:
        group = {r.method: r.median_s for r in rows if (r.tree, r.plan) == (size, plan)}
        ours = group.get("meshbind")
        best = min((group[m] for m in PYTHON_BASELINES if group.get(m) is not None), default=None)  # type: ignore[type-var]
        parts = []
        if best and ours:
            parts.append(f"fastest Python baseline / meshbind = {best / ours:.1f}x")
        if group.get("torch_parallelize_module") and ours:
            parts.append(f"torch / meshbind = {group['torch_parallelize_module'] / ours:.1f}x")  # type: ignore[operator]
        if group.get("torch_parallelize_module") and group.get("meshbind_validate"):
            parts.append(f"torch / meshbind_validate = {group['torch_parallelize_module'] / group['meshbind_validate']:.2f}x")  # type: ignore[operator]
        if group.get("meshbind_validate") and ours:
            parts.append(f"meshbind_validate / meshbind = {group['meshbind_validate'] / ours:.1f}x")  # type: ignore[operator]
        if group.get("rust_walk_floor") and ours:
            parts.append(f"meshbind / rust_walk_floor = {ours / group['rust_walk_floor']:.2f}x")  # type: ignore[operator]
        if group.get("hand_pruned_walk") and ours:
            parts.append(f"meshbind / hand_pruned_walk = {ours / group['hand_pruned_walk']:.2f}x")  # type: ignore[operator]
        if parts:
            lines.append(f"{size} {plan}: " + "; ".join(parts))
    trees = [r for r in rows if r.method == "meshbind" and r.median_s and r.tree in ("61x256", "61x1024")]
    for plan in dict.fromkeys(r.plan for r in trees):
        cost = {r.tree: r.median_s / r.modules for r in trees if r.plan == plan and r.median_s}
        if len(cost) == 2:
            lines.append(
                f"{plan}: meshbind cost per module 61x1024 / 61x256 = {cost['61x1024'] / cost['61x256']:.2f} (linear: 1.0)"
            )
    return lines


def table(rows: Sequence[Row], markdown: bool = False) -> list[str]:
    header = ("tree", "modules", "plan", "method", "median s", "runs", "matches", "noticed typo", "x meshbind")
    lines = []
    for row in rows:
        reference = _reference(rows, row)
        median = ("skip" if row.skipped else "n/a") if row.median_s is None else f"{row.median_s:.4f}"
        ratio = "" if row.median_s is None or not reference else f"{row.median_s / reference:.2f}"
        noticed = "" if row.noticed is None or row.plan != "typo" else ("yes" if row.noticed else "no")
        matches = "" if row.matches is None else str(row.matches)
        lines.append((row.tree, str(row.modules), row.plan, row.method, median, str(row.runs), matches, noticed, ratio))
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return out + ["| " + " | ".join(line) + " |" for line in lines]
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]
    return [
        "  ".join(
            cell.rjust(w) if i in (1, 4, 5, 6, 8) else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in [header, *lines]
    ]


def machine() -> str:
    import meshbind

    cores = os.cpu_count()
    return (
        f"{platform.machine()}, {cores} cores, {platform.system()}; CPython {platform.python_version()}, "
        f"torch {torch.__version__}, meshbind {getattr(meshbind, '__version__', 'dev')}"
    )


def plot(rows: Sequence[Row], path: str) -> None:
    """Log-log, one panel per plan: time against module count, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = list(dict.fromkeys(r.plan for r in rows))
    columns = min(3, len(plans))
    figure, grid = plt.subplots(
        (len(plans) + columns - 1) // columns,
        columns,
        figsize=(5 * columns, 4 * ((len(plans) + columns - 1) // columns)),
        squeeze=False,
    )
    methods = list(dict.fromkeys(r.method for r in rows))
    colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for axes, plan in zip(grid.flat, plans, strict=False):
        for method in methods:
            points = sorted((r.modules, r.median_s) for r in rows if r.plan == plan and r.method == method and r.median_s)
            if points:
                xs, ys = zip(*points, strict=True)
                style = "-" if method.startswith("meshbind") else "--"
                axes.plot(xs, ys, style, marker="o", color=colors[method], label=method)
        axes.set(xscale="log", yscale="log", title=plan, xlabel="modules (or FQNs)", ylabel="median seconds")
        axes.grid(True, which="both", alpha=0.3)
    for axes in list(grid.flat)[len(plans) :]:
        axes.axis("off")
    grid.flat[0].legend(fontsize=7)
    figure.suptitle("Plan resolution: meshbind against the baselines")
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)


def make_output_folder(flag: str, path: str) -> None:
    """The folder of an output file, made before the run rather than failing after it."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot make its folder: {error.strerror}") from None


def parser(
    prog: str, description: str, sizes: str, plans: str, plot: str | None, methods: Sequence[str]
) -> argparse.ArgumentParser:
    """The flags of ``plan_resolution.py``, with their defaults."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=Size.parse_list, default=Size.parse_list(sizes))
    parser.add_argument("--plans", default=plans, help=f"comma-separated, of {sorted(PLANS)}")
    parser.add_argument("--methods", default=",".join(methods), help=f"comma-separated, of {list(methods)}")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--plot", metavar="PATH", default=plot, help="write a log-log PNG")
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None, methods: Mapping[str, Method]) -> argparse.Namespace:
    """The arguments, checked before anything runs: plans, methods, repeat and output folders."""
    args = parser.parse_args(argv)
    args.plans = args.plans.split(",")
    args.methods = args.methods.split(",")
    unknown = [p for p in args.plans if p not in PLANS] + [m for m in args.methods if m not in methods]
    if unknown:
        parser.error(f"unknown plans or methods {unknown}; plans: {sorted(PLANS)}, methods: {list(methods)}")
    if args.repeat < 5:
        parser.error("--repeat must be at least 5 (medians of fewer runs are noise)")
    try:
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            if path:
                make_output_folder(flag, path)
    except ValueError as error:
        parser.error(str(error))
    return args


def report(args: argparse.Namespace, rows: Sequence[Row]) -> None:
    """The table and the ratios on stdout; the rows as JSON and the plot where asked."""
    print(f"machine: {machine()}")
    print("\n".join(table(rows)))
    print("\n".join(summary(rows)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rows": [asdict(row) for row in rows]}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {os.path.abspath(args.plot)}")
