"""The resolved plan, built from the planned modules: immutable, in tree order, with a table and a JSON form."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from meshbind.errors import PlanProblem
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
        lines += [f"warning: {warning.line()}" for warning in self.warnings]
        return "\n".join(lines)

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
    )
