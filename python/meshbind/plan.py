"""Plan resolution (SPEC §4): one walk, every problem collected, one ``PlanError``.

Requests and override patterns are compiled into one ``PatternSet`` and matched in a single full
walk of the tree (Rust), which also reports every class met, so family modules are found without
a second pass. Then, in tree order: ownership (``conflict``), nesting (``nested``), layouts from the
providers with overrides merged (``layout``), and the §5 checks of ``ValidationBatch``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import is_
from types import MappingProxyType
from typing import Any

from torch import nn

from meshbind._core import ModuleTree, PatternSet
from meshbind.family import any_family_class, family_spec, record_family_layout
from meshbind.specs import (
    SHARDING_FIELDS,
    LayoutContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    is_int_from,
)
from meshbind.validation import ValidationBatch, placements_text

_FAMILY = -1


@dataclass(frozen=True)
class PlanProblem:
    """One problem: its code (SPEC §4), the FQN it concerns (``None`` for a pattern), the request, why."""

    code: str
    fqn: str | None
    request: str | None
    message: str

    def line(self) -> str:
        where = "(pattern)" if self.fqn is None else repr(self.fqn)
        source = f" [{self.request}]" if self.request else ""
        return f"{self.code:<9} {where}: {self.message}{source}"


class PlanError(ValueError):
    """Every problem of a plan, sorted by FQN; ``problems`` holds them as ``PlanProblem``."""

    def __init__(self, problems: Sequence[PlanProblem]) -> None:
        self.problems = tuple(sorted(problems, key=lambda p: (p.fqn is not None, p.fqn or "", p.code)))
        count = len(self.problems)
        lines = "\n".join("  " + p.line() for p in self.problems)
        super().__init__(f"the plan has {count} problem{'s' if count != 1 else ''}:\n{lines}")


@dataclass(frozen=True)
class ParallelPlan:
    """A resolved, validated plan: immutable, in tree order."""

    parallel_modules: Mapping[str, ParallelModuleSpec]
    sharding: Mapping[str, ModuleShardingSpec]
    context: LayoutContext
    sources: Mapping[str, str]
    """Which request (``requests[i]``) or family class put each module in the plan."""

    def explain(self) -> str:
        """A table: FQN, protocol, binding kind, source and parameter placements."""
        header = ("FQN", "protocol", "kind", "source", "params")
        rows = [
            (
                fqn or "<root>",
                f"{spec.protocol} v{spec.version}",
                spec.binding_kind,
                self.sources[fqn],
                ", ".join(
                    f"{path}=" + "/".join(f"{axis}:{p}" for axis, p in named.items())
                    for path, named in self.sharding[fqn].params.items()
                )
                or "-",
            )
            for fqn, spec in self.parallel_modules.items()
        ]
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in [header, *rows]]
        axes = ", ".join(f"{axis}={size}" for axis, size in self.context.axis_sizes.items())
        lines.append(f"{len(rows)} planned module{'s' if len(rows) != 1 else ''}; layout {axes or '(no axes)'}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the context and every planned module with its spec and sharding."""
        return {
            "context": dict(self.context.axis_sizes),
            "modules": [
                {
                    "fqn": fqn,
                    "protocol": spec.protocol,
                    "version": spec.version,
                    "binding_kind": spec.binding_kind,
                    "source": self.sources[fqn],
                    "sharding": self.sharding[fqn].to_dict(),
                }
                for fqn, spec in self.parallel_modules.items()
            ],
        }


def resolve_plan(
    model: nn.Module | Sequence[str],
    requests: Sequence[NativeParallelBindingRequest],
    context: LayoutContext,
    *,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    param_shapes: Mapping[str, Sequence[int]] | None = None,
) -> ParallelPlan:
    """Resolve and validate a plan over a module tree or, offline, a sequence of FQNs.

    ``overrides`` maps a pattern to sharding fields (``{"params": ...}``) that replace the
    provider's fields on every planned module it selects, in the mapping's order. Offline,
    ``param_shapes`` (``{"layers.0.mlp.w1": (8, 16, 32)}``) enables the shape checks, the providers
    receive ``module=None``, and the class-level rules and ``validate`` (which need a module) do
    not run; with a module, whose own parameters give the shapes, ``param_shapes`` is refused.
    Raises ``PlanError`` listing every problem.
    """
    requests = _checked_requests(requests)
    if not isinstance(context, LayoutContext):
        raise TypeError(f"context must be a LayoutContext, got {type(context).__name__}")
    override_items = _checked_overrides(overrides)
    shapes = _checked_param_shapes(param_shapes, model)
    patterns = [pattern for request in requests for pattern in request.match]
    owners = [index for index, request in enumerate(requests) for _ in request.match]
    patterns += [pattern for pattern, _ in override_items]
    owners += [-1 - index for index in range(len(override_items))]
    pattern_set = PatternSet(patterns)
    tree, offline = _index(pattern_set, model)
    return _Resolution(model, requests, context, override_items, shapes, tree, offline, patterns, owners).run()


def _family_sharding(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    """A family member's layout provider: its own ``parallel_sharding``."""
    provider = getattr(type(module), "parallel_sharding", None)
    if provider is None:
        raise TypeError(f"family class {type(module).__qualname__} defines no parallel_sharding(fqn, context)")
    result: ModuleShardingSpec = provider(module, fqn, context)
    return result


def _field_texts(sharding: ModuleShardingSpec) -> dict[str, str]:
    """Each field of a sharding as messages show it."""
    texts = {"params": "{" + ", ".join(f"{path}: {placements_text(p)}" for path, p in sharding.params.items()) + "}"}
    texts |= {field: placements_text(getattr(sharding, field)) for field in ("in_src", "in_dst", "out_src")}
    texts["out_dst"] = "None" if sharding.out_dst is None else placements_text(sharding.out_dst)
    texts["expert_stack"] = str(sharding.expert_stack)
    return texts


def _checked_requests(requests: object) -> list[NativeParallelBindingRequest]:
    if isinstance(requests, (str, NativeParallelBindingRequest)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a sequence of NativeParallelBindingRequest, got {type(requests).__name__}")
    for index, request in enumerate(requests):
        if not isinstance(request, NativeParallelBindingRequest):
            raise TypeError(f"requests[{index}] must be a NativeParallelBindingRequest, got {type(request).__name__}")
    return list(requests)


def _checked_overrides(overrides: object) -> list[tuple[str, Mapping[str, Any]]]:
    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must map patterns to sharding fields, got {type(overrides).__name__}")
    for pattern, fields in overrides.items():
        if not isinstance(pattern, str) or not isinstance(fields, Mapping):
            raise TypeError(f"overrides[{pattern!r}] must map a pattern str to a mapping of sharding fields")
    return list(overrides.items())


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


def _index(pattern_set: PatternSet, model: object) -> tuple[ModuleTree, bool]:
    """The matches over the model. The walk prunes subtrees no pattern can reach unless that
    could hide something: a family member (when a family class exists), or an alias of a selected
    module (which keys it when it comes first, and may place it inside another bound module)."""
    if isinstance(model, nn.Module):
        if not any_family_class():
            tree = pattern_set.walk(model, prune=True, modules=True)
            if not tree.may_share_matches:
                return tree, False
        return pattern_set.walk(model, prune=False), False
    if isinstance(model, str) or not isinstance(model, Sequence):
        raise TypeError(f"model must be an nn.Module or a sequence of FQNs, got {type(model).__name__}")
    names = list(model)
    if len(set(names)) != len(names):
        seen: set[str] = set()
        duplicate = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
        raise ValueError(f"the FQN list names {duplicate!r} more than once")
    return pattern_set.index_names(names), True


class _Resolution:
    """One resolve_plan call; ``run`` reads top to bottom as the SPEC §4 steps."""

    def __init__(
        self,
        model: nn.Module | Sequence[str],
        requests: list[NativeParallelBindingRequest],
        context: LayoutContext,
        overrides: list[tuple[str, Mapping[str, Any]]],
        param_shapes: Mapping[str, tuple[int, ...]] | None,
        tree: ModuleTree,
        offline: bool,
        patterns: list[str],
        owners: list[int],
    ) -> None:
        self.model = model
        self.requests = requests
        self.context = context
        self.overrides = overrides
        self.param_shapes = param_shapes
        self.tree = tree
        self.offline = offline
        self.patterns = patterns
        self.owners = owners
        self.problems: list[PlanProblem] = []
        self.all_names: ModuleTree | None = None
        self.sharing: dict[int, list[int]] = {}
        """Module → the other requests (with its first request's spec) that select it too."""
        self.family_specs: dict[int, ParallelModuleSpec] = {}
        self.classes: list[type] = [] if offline else tree.classes()
        self.module_classes: list[int] = [] if offline else tree.module_classes()

    def run(self) -> ParallelPlan:
        self._report_cycles()
        planned, request_of, override_hits = self._assign_requests()
        if self._find_family_specs():
            planned, request_of = self._join_families(planned, request_of)
        fqns = self.tree.module_fqns(planned)
        modules: list[nn.Module | None] = [None] * len(planned) if self.offline else self.tree.modules(planned)  # type: ignore[assignment]
        specs, sources = self._specs_and_sources(planned, request_of, modules)
        self._report_unmatched(planned, fqns, override_hits)
        self._report_nested(planned, fqns, specs)
        shardings = self._shardings(planned, request_of, modules, fqns, sources, override_hits)
        if any(map(is_, shardings, repeat(None))):
            rows = [row for row, sharding in enumerate(shardings) if sharding is not None]
            planned, modules, fqns, specs, sources = (  # type: ignore[assignment]
                [values[row] for row in rows] for values in (planned, modules, fqns, specs, sources)
            )
            shardings = [shardings[row] for row in rows]
        batch = ValidationBatch(self.context, self.param_shapes)
        classes = None if self.offline else list(map(self.classes.__getitem__, map(self.module_classes.__getitem__, planned)))
        reported = self._sources_with_overrides(planned, sources, override_hits)
        for row, code, message in batch.check(modules, fqns, specs, shardings, classes):  # type: ignore[arg-type]
            self.problems.append(PlanProblem(code, fqns[row], reported[row], message))
        if self.problems:
            raise PlanError(self.problems)
        plan = ParallelPlan(
            parallel_modules=MappingProxyType(dict(zip(fqns, specs, strict=True))),
            sharding=MappingProxyType(dict(zip(fqns, shardings, strict=True))),  # type: ignore[arg-type]
            context=self.context,
            sources=MappingProxyType(dict(zip(fqns, sources, strict=True))),
        )
        self._record_families(planned, modules, fqns, specs, shardings)
        return plan

    def _report_cycles(self) -> None:
        for alias, ancestor in self.tree.cycles():
            message = f"this FQN names its own ancestor {ancestor!r}: the module tree has a cycle of shared modules"
            self.problems.append(PlanProblem("layout", alias, None, message))

    def _assign_requests(self) -> tuple[list[int], list[int], dict[int, list[int]]]:
        """The selected modules in tree order with their first requests (conflicts reported and
        dropped; other requests with an equal spec kept in ``sharing``), and module → override
        indices."""
        request_of_pattern = [owner if owner >= 0 else None for owner in self.owners]
        planned, request_of, others = self.tree.owners(request_of_pattern)
        if others:
            first = dict(zip(planned, request_of, strict=True))
            specs = [request.parallel for request in self.requests]
            conflicts = sorted(
                {(m, first[m], r) for m, r in others if specs[first[m]] is not specs[r] and specs[first[m]] != specs[r]}
            )
            for module, first_request, second in conflicts:
                fqn = self.tree.module_fqns([module])[0]
                a, b = specs[first_request], specs[second]
                message = (
                    f"selected by requests[{first_request}] ({a.describe()}) and requests[{second}] ({b.describe()}) "
                    "with different specs"
                )
                self.problems.append(PlanProblem("conflict", fqn, f"requests[{first_request}], requests[{second}]", message))
            dropped = {module for module, _, _ in conflicts}
            for module, second in sorted(others):
                if module not in dropped:
                    self.sharing.setdefault(module, []).append(second)
            if dropped:
                kept = [row for row, module in enumerate(planned) if module not in dropped]
                planned, request_of = [planned[row] for row in kept], [request_of[row] for row in kept]
        override_hits: dict[int, list[int]] = {}
        if self.overrides:
            override_of = [-1 - owner if owner < 0 else None for owner in self.owners]
            modules, first_override, more = self.tree.owners(override_of)
            override_hits = {module: [index] for module, index in zip(modules, first_override, strict=True)}
            for module, index in more:
                override_hits[module].append(index)
            for hits in override_hits.values():
                hits.sort()
        return planned, request_of, override_hits

    def _find_family_specs(self) -> bool:
        """Collect the family classes met by the walk; whether there is any."""
        for index, cls in enumerate(self.classes):
            spec = family_spec(cls)
            if spec is None:
                continue
            if not isinstance(spec, ParallelModuleSpec):
                message = f"{cls.__qualname__}.parallel_spec must be a ParallelModuleSpec, got {type(spec).__name__}"
                self.problems.append(PlanProblem("binding", None, f"family {cls.__qualname__}", message))
                continue
            self.family_specs[index] = spec
        return bool(self.family_specs)

    def _join_families(self, planned: list[int], request_of: list[int]) -> tuple[list[int], list[int]]:
        """Family members join the plan; a request giving one a different spec is a conflict."""
        owner = dict(zip(planned, request_of, strict=True))
        for module in self.tree.modules_of_classes(list(self.family_specs)):
            spec = self.family_specs[self.module_classes[module]]
            request = owner.get(module)
            if request is None:
                owner[module] = _FAMILY
            elif self.requests[request].parallel != spec:
                cls = self.classes[self.module_classes[module]]
                message = (
                    f"requests[{request}] gives it {self.requests[request].parallel.describe()}, "
                    f"but its class {cls.__qualname__} owns {spec.describe()}"
                )
                fqn = self.tree.module_fqns([module])[0]
                self.problems.append(PlanProblem("conflict", fqn, f"requests[{request}], family {cls.__qualname__}", message))
                del owner[module]
        planned = sorted(owner)
        return planned, list(map(owner.__getitem__, planned))

    def _specs_and_sources(
        self, planned: list[int], request_of: list[int], modules: list[nn.Module | None]
    ) -> tuple[list[ParallelModuleSpec], list[str]]:
        """Each planned module's spec, and the request or family class that put it in the plan."""
        # _FAMILY (-1) reads the placeholder at the end; family rows are filled in below.
        request_specs: list[Any] = [request.parallel for request in self.requests] + [None]
        labels = [f"requests[{index}]" for index in range(len(self.requests))] + [""]
        specs: list[ParallelModuleSpec] = list(map(request_specs.__getitem__, request_of))
        sources: list[str] = list(map(labels.__getitem__, request_of))
        if self.family_specs:
            for row, request in enumerate(request_of):
                if request == _FAMILY:
                    specs[row] = self.family_specs[self.module_classes[planned[row]]]
                    sources[row] = f"family {type(modules[row]).__qualname__}"
        return specs, sources

    def _report_unmatched(self, planned: list[int], fqns: list[str], override_hits: dict[int, list[int]]) -> None:
        """Patterns that select nothing; an override's suggestions are planned modules, the only
        ones it may select."""
        counts = self.tree.hit_counts()
        planned_names: ModuleTree | None = None
        planned_set = set(planned) if override_hits else set()
        overrides_used = {o for module, hits in override_hits.items() if module in planned_set for o in hits}
        for index, (pattern, request) in enumerate(zip(self.patterns, self.owners, strict=True)):
            if request >= 0 and counts[index] == 0:
                source = f"requests[{request}]"
            elif request < 0 and -1 - request not in overrides_used:
                source = f"overrides[{pattern!r}]"
            else:
                continue
            if request >= 0:
                nearest = self._every_name().nearest(pattern, 3)
            else:
                if planned_names is None:
                    planned_names = PatternSet([]).index_names(fqns, prune=False)
                nearest = planned_names.nearest(pattern, 3)
            hint = f"; did you mean {', '.join(repr(n) for n in nearest)}?" if nearest else ""
            what = "any module" if request >= 0 else "any planned module"
            self.problems.append(PlanProblem("unmatched", None, source, f"pattern {pattern!r} does not select {what}{hint}"))

    def _every_name(self) -> ModuleTree:
        """An index of every FQN, for "did you mean" (a pruned index recorded only matches)."""
        if self.tree.complete:
            return self.tree
        if self.all_names is None:
            every = PatternSet([])
            if isinstance(self.model, nn.Module):
                self.all_names = every.walk(self.model, prune=False)
            else:
                self.all_names = every.index_names(self.model, prune=False)
        return self.all_names

    def _report_nested(self, planned: list[int], fqns: list[str], specs: list[ParallelModuleSpec]) -> None:
        """A bound module is nested when one of its FQNs (aliases included: a shared module sits
        in each place) lies below an FQN of another bound module of the same kind. The FQNs come
        in preorder, so each kind's open ancestors form a stack."""
        possible = [request.parallel for request in self.requests] + list(self.family_specs.values())
        if all(spec.binding_kind == "none" for spec in possible):
            return
        kinds = {row: spec.binding_kind for row, spec in enumerate(specs) if spec.binding_kind != "none"}
        if self.tree.complete and len(self.tree) > self.tree.module_count:  # the tree has aliases
            row_of_module = {planned[row]: row for row in kinds}
            rows_of_names = map(row_of_module.get, self.tree.name_modules())
            names = [(name, row) for name, row in zip(self.tree.names(), rows_of_names, strict=True) if row is not None]
        else:
            names = [(fqns[row], row) for row in kinds]  # rows are in tree order
        outer_of: dict[int, int] = {}
        open_by_kind: dict[str, list[tuple[str, int]]] = {}
        for name, row in names:
            stack = open_by_kind.setdefault(kinds[row], [])
            while stack and not (stack[-1][0] == "" or name.startswith(stack[-1][0] + ".")):
                stack.pop()
            if row not in outer_of:
                outer = next((other for _, other in reversed(stack) if other != row), None)
                if outer is not None:
                    outer_of[row] = outer
            stack.append((name, row))
        for row, outer in outer_of.items():
            kind = kinds[row]
            message = f"a {kind!r} module inside the {kind!r} module {fqns[outer]!r}"
            self.problems.append(PlanProblem("nested", fqns[row], None, message))

    def _shardings(
        self,
        planned: list[int],
        request_of: list[int],
        modules: list[nn.Module | None],
        fqns: list[str],
        sources: list[str],
        override_hits: dict[int, list[int]],
    ) -> list[ModuleShardingSpec | None]:
        """Every planned module's layout from its provider, overrides merged; ``None`` after a problem."""
        shardings = self._provided(request_of, modules, fqns, sources)
        if self.sharing:
            self._check_shared_layouts(planned, request_of, modules, fqns, shardings)
        if override_hits:
            for row, module_index in enumerate(planned):
                sharding = shardings[row]
                if module_index in override_hits and sharding is not None:
                    shardings[row] = self._override(sharding, fqns[row], override_hits[module_index])
        return shardings

    def _provided(
        self, request_of: Sequence[int], modules: Sequence[nn.Module | None], fqns: Sequence[str], sources: Sequence[str]
    ) -> list[ModuleShardingSpec | None]:
        """Each module's layout from its request's provider; ``None`` where it raised or returned no spec."""
        context = self.context
        # Index _FAMILY (-1) is the last entry: the family member's own method.
        providers = [request.sharding for request in self.requests] + [_family_sharding]
        shardings: list[ModuleShardingSpec | None] = []
        append = shardings.append
        for request, module, fqn, source in zip(request_of, modules, fqns, sources, strict=True):
            try:
                sharding = providers[request](module, fqn, context)
            except Exception as error:
                message = f"the layout provider raised {type(error).__name__}: {error}"
                self.problems.append(PlanProblem("layout", fqn, source, message))
                sharding = None
            else:
                if not isinstance(sharding, ModuleShardingSpec):
                    message = f"the layout provider returned {type(sharding).__name__}, not a ModuleShardingSpec"
                    self.problems.append(PlanProblem("layout", fqn, source, message))
                    sharding = None
            append(sharding)
        return shardings

    def _check_shared_layouts(
        self,
        planned: list[int],
        request_of: list[int],
        modules: list[nn.Module | None],
        fqns: list[str],
        shardings: list[ModuleShardingSpec | None],
    ) -> None:
        """Requests with equal specs share a module only when their providers give it one layout:
        otherwise which one binds it would depend on the order of the requests. Every other
        provider is called in one batch; a module whose layouts differ is dropped as a conflict."""
        pairs = [
            (row, other)
            for row, module_index in enumerate(planned)
            if module_index in self.sharing and shardings[row] is not None
            for other in self.sharing[module_index]
        ]
        theirs = self._provided(
            [other for _, other in pairs],
            [modules[row] for row, _ in pairs],
            [fqns[row] for row, _ in pairs],
            [f"requests[{other}]" for _, other in pairs],
        )
        for (row, other), layout in zip(pairs, theirs, strict=True):
            ours = shardings[row]
            if ours is None or layout is ours or layout == ours:  # dropped by an earlier pair, or agreeing
                continue
            if layout is None:  # that provider failed: its layout problem is reported
                shardings[row] = None
                continue
            first = request_of[row]
            mine, differing = _field_texts(ours), _field_texts(layout)
            fields = "; ".join(f"{key} {mine[key]} against {differing[key]}" for key in mine if mine[key] != differing[key])
            message = (
                f"selected by requests[{first}] and requests[{other}] with equal specs "
                f"({self.requests[first].parallel.describe()}) but different layouts: {fields}"
            )
            self.problems.append(PlanProblem("conflict", fqns[row], f"requests[{first}], requests[{other}]", message))
            shardings[row] = None

    def _sources_with_overrides(self, planned: list[int], sources: list[str], override_hits: dict[int, list[int]]) -> list[str]:
        """What a module's problems name: its source, and every override merged into its sharding."""
        if not override_hits:
            return sources
        labels = [f"overrides[{pattern!r}]" for pattern, _ in self.overrides]
        return [
            ", ".join([source, *map(labels.__getitem__, override_hits[module])]) if module in override_hits else source
            for module, source in zip(planned, sources, strict=True)
        ]

    def _override(self, sharding: ModuleShardingSpec, fqn: str, overrides: Sequence[int]) -> ModuleShardingSpec | None:
        """Merge the overrides in order: a field an override sets wins, the others stay derived."""
        for override in overrides:
            pattern, fields = self.overrides[override]
            unknown = sorted(set(fields) - set(SHARDING_FIELDS))
            try:
                if unknown:
                    raise ValueError(f"unknown sharding fields {unknown} (an override may set {list(SHARDING_FIELDS)})")
                sharding = dataclasses.replace(sharding, **fields)
            except (TypeError, ValueError) as error:
                self.problems.append(PlanProblem("layout", fqn, f"overrides[{pattern!r}]", f"the override failed: {error}"))
                return None
        return sharding

    def _record_families(
        self,
        planned: list[int],
        modules: list[nn.Module | None],
        fqns: list[str],
        specs: list[ParallelModuleSpec],
        shardings: list[ModuleShardingSpec | None],
    ) -> None:
        if not self.family_specs:
            return
        for row, module_index in enumerate(planned):
            module, sharding = modules[row], shardings[row]
            if module is not None and sharding is not None and self.module_classes[module_index] in self.family_specs:
                record_family_layout(module, fqns[row], specs[row], sharding)
