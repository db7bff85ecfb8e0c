"""The resolved plan, built from the planned modules: immutable, in tree order, with a table and a JSON form."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from meshbind.errors import PlanProblem
from meshbind.model_index import ModelIndex
from meshbind.resolution.fsdp import FSDPPlan
from meshbind.resolution.selection import PlannedModules
from meshbind.specs import LayoutContext, ModuleShardingSpec, ParallelModuleSpec


@dataclass(frozen=True)
class ParallelPlan:
    """A resolved, validated plan: immutable, in tree order."""

    parallel_modules: Mapping[str, ParallelModuleSpec]
    sharding: Mapping[str, ModuleShardingSpec]
    context: LayoutContext
    sources: Mapping[str, str]
    """Which request (``requests[i]``) or family class put each module in the plan."""
    warnings: tuple[PlanProblem, ...] = ()
    """What is worth knowing but no problem: an optional request's pattern that selects nothing."""
    fsdp: FSDPPlan | None = None
    """The FSDP units, bottom-up with the root last (``resolve_plan(..., fully_shard=)``)."""
    classes: tuple[type, ...] | None = None
    """The class of each planned module, in ``parallel_modules``' order, as resolution checked its
    class rules; ``None`` for a plan resolved offline, which checked none. Binding checks a
    module only when its class is not this one."""
    index: ModelIndex | None = field(default=None, compare=False, repr=False)
    """The model index resolution walked (``resolve_plan(..., index=True)``, or for FSDP units);
    ``None`` otherwise. It answers for the model it was walked from only."""

    def only(self, keep: Callable[[str], bool]) -> ParallelPlan:
        """The plan of a model holding only the modules whose FQN ``keep`` admits (step memory's
        shallower copies of a model): the planned modules and FSDP units kept, the root's unit
        always; no index (``ModelIndex.restricted`` makes the copy's)."""
        kept = [fqn for fqn in self.parallel_modules if keep(fqn)]
        classes = self.classes
        if classes is not None:
            class_of = dict(zip(self.parallel_modules, classes, strict=True))
            classes = tuple(class_of[fqn] for fqn in kept)
        fsdp = self.fsdp
        if fsdp is not None:
            fsdp = replace(fsdp, units=tuple(unit for unit in fsdp.units if not unit.fqn or keep(unit.fqn)))
        return ParallelPlan(
            parallel_modules=MappingProxyType({fqn: self.parallel_modules[fqn] for fqn in kept}),
            sharding=MappingProxyType({fqn: self.sharding[fqn] for fqn in kept}),
            context=self.context,
            sources=MappingProxyType({fqn: self.sources[fqn] for fqn in kept}),
            warnings=self.warnings,
            fsdp=fsdp,
            classes=classes,
        )

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
        if self.fsdp is not None:
            lines.append(self.fsdp.describe())
        return "\n".join([*lines, *self.warning_lines()])

    def warning_lines(self) -> list[str]:
        """One ``warning: ...`` line per warning, as ``explain`` and the report's text end."""
        return [f"warning: {warning.line()}" for warning in self.warnings]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the context and every planned module with its spec and sharding."""
        return {
            "context": dict(self.context.axis_sizes),
            "warnings": [w.to_dict() for w in self.warnings],
            "fsdp": None if self.fsdp is None else self.fsdp.to_dict(),
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


def build_plan(
    laid_out: PlannedModules,
    context: LayoutContext,
    warnings: tuple[PlanProblem, ...],
    fsdp: FSDPPlan | None,
    offline: bool,
    index: ModelIndex | None,
) -> ParallelPlan:
    """The plan of modules that all have their layout."""

    def mapping(column: Sequence[Any]) -> MappingProxyType[str, Any]:
        return MappingProxyType(dict(zip(laid_out.fqns, column, strict=True)))

    return ParallelPlan(
        parallel_modules=mapping(laid_out.specs),
        sharding=mapping(laid_out.shardings),
        context=context,
        sources=mapping(laid_out.sources),
        warnings=warnings,
        fsdp=fsdp,
        classes=None if offline else tuple(laid_out.classes),  # type: ignore[arg-type]
        index=index,
    )
