"""meshbind: resolve, validate and bind large-model parallel plans onto PyTorch module trees.

``__all__`` lists what users call and the errors they catch. The results those calls return
(``ParallelPlan``, ``PlanProblem``, ``ModuleTree``, ``IndexMatches``, ``BoundModule``,
``FamilyBuildInfo``, ``FamilyLayout``, ``RoutedTokens``) are importable from here too, for type
hints, but are not entry points.

Each is imported when first used: ``import meshbind`` (and the command line's help and argument
errors) stays free of torch and transformers until a name that needs them is read.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshbind._core import IndexMatches as IndexMatches
    from meshbind._core import ModuleTree as ModuleTree
    from meshbind._core import PatternSet
    from meshbind.binding import BoundModule as BoundModule
    from meshbind.binding import ParallelBinding, bind_parallel_modules, bound_modules, validate_materialized_modules
    from meshbind.comms.result import StepComms as StepComms
    from meshbind.comms.trace import step_comms
    from meshbind.comms.with_memory import step_memory_and_comms
    from meshbind.cp import CPContext
    from meshbind.ep import EPContext
    from meshbind.ep import RoutedTokens as RoutedTokens
    from meshbind.errors import (
        BindingError,
        BindingRefusedError,
        CheckpointError,
        LayoutError,
        MaterializationError,
        MeshbindError,
        PatternError,
        PlanError,
        RankMismatchError,
        StepMemoryError,
        describe_problem_codes,
    )
    from meshbind.errors import PlanProblem as PlanProblem
    from meshbind.errors import ProblemCode as ProblemCode
    from meshbind.family import FamilyBuildInfo as FamilyBuildInfo
    from meshbind.family import FamilyLayout as FamilyLayout
    from meshbind.family import get_family_build_info
    from meshbind.fsdp import apply_fully_shard
    from meshbind.fsdp_request import FullyShard, UnitPrecision
    from meshbind.interop.hf_plans import apply_hf_plan, from_hf_plan
    from meshbind.interop.torch_plans import from_torch_plan, parallelize_checked
    from meshbind.layouts import apply_layouts
    from meshbind.memory.result import StepMemory as StepMemory
    from meshbind.memory.trace import step_memory
    from meshbind.mesh import MeshBinding, MeshContext
    from meshbind.report import PlanReport as PlanReport
    from meshbind.report import plan_report
    from meshbind.resolution import ParallelPlan as ParallelPlan
    from meshbind.resolution import resolve_plan
    from meshbind.routing import Routing
    from meshbind.specs import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec
    from meshbind.steptime.cluster import GPUS, Cluster
    from meshbind.steptime.estimate import step_time
    from meshbind.steptime.result import StepTime as StepTime
    from meshbind.validation import validate_parallel_module
    from meshbind.world import World

_HOMES = {
    "apply_fully_shard": "meshbind.fsdp",
    "apply_hf_plan": "meshbind.interop.hf_plans",
    "apply_layouts": "meshbind.layouts",
    "bind_parallel_modules": "meshbind.binding",
    "BindingError": "meshbind.errors",
    "BindingRefusedError": "meshbind.errors",
    "bound_modules": "meshbind.binding",
    "BoundModule": "meshbind.binding",
    "CheckpointError": "meshbind.errors",
    "CPContext": "meshbind.cp",
    "describe_problem_codes": "meshbind.errors",
    "EPContext": "meshbind.ep",
    "FamilyBuildInfo": "meshbind.family",
    "FamilyLayout": "meshbind.family",
    "from_hf_plan": "meshbind.interop.hf_plans",
    "from_torch_plan": "meshbind.interop.torch_plans",
    "FullyShard": "meshbind.fsdp_request",
    "UnitPrecision": "meshbind.fsdp_request",
    "get_family_build_info": "meshbind.family",
    "IndexMatches": "meshbind._core",
    "LayoutContext": "meshbind.specs",
    "LayoutError": "meshbind.errors",
    "MaterializationError": "meshbind.errors",
    "MeshbindError": "meshbind.errors",
    "MeshBinding": "meshbind.mesh",
    "MeshContext": "meshbind.mesh",
    "ModuleShardingSpec": "meshbind.specs",
    "ModuleTree": "meshbind._core",
    "NativeParallelBindingRequest": "meshbind.specs",
    "ParallelBinding": "meshbind.binding",
    "parallelize_checked": "meshbind.interop.torch_plans",
    "ParallelModuleSpec": "meshbind.specs",
    "ParallelPlan": "meshbind.resolution",
    "PatternError": "meshbind.errors",
    "PatternSet": "meshbind._core",
    "plan_report": "meshbind.report",
    "PlanError": "meshbind.errors",
    "PlanProblem": "meshbind.errors",
    "PlanReport": "meshbind.report",
    "ProblemCode": "meshbind.errors",
    "RankMismatchError": "meshbind.errors",
    "resolve_plan": "meshbind.resolution",
    "RoutedTokens": "meshbind.ep",
    "Routing": "meshbind.routing",
    "step_comms": "meshbind.comms.trace",
    "StepComms": "meshbind.comms.result",
    "step_time": "meshbind.steptime.estimate",
    "StepTime": "meshbind.steptime.result",
    "Cluster": "meshbind.steptime.cluster",
    "GPUS": "meshbind.steptime.cluster",
    "step_memory": "meshbind.memory.trace",
    "step_memory_and_comms": "meshbind.comms.with_memory",
    "StepMemory": "meshbind.memory.result",
    "StepMemoryError": "meshbind.errors",
    "validate_materialized_modules": "meshbind.binding",
    "validate_parallel_module": "meshbind.validation",
    "World": "meshbind.world",
}
"""Each public name, and the module it lives in."""


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'meshbind' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # read once: later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


try:
    __version__ = metadata.version("meshbind")
except metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "unknown"
__all__ = [
    "GPUS",
    "BindingError",
    "BindingRefusedError",
    "CPContext",
    "CheckpointError",
    "Cluster",
    "EPContext",
    "FullyShard",
    "LayoutContext",
    "LayoutError",
    "MaterializationError",
    "MeshBinding",
    "MeshContext",
    "MeshbindError",
    "ModuleShardingSpec",
    "NativeParallelBindingRequest",
    "ParallelBinding",
    "ParallelModuleSpec",
    "PatternError",
    "PatternSet",
    "PlanError",
    "RankMismatchError",
    "Routing",
    "StepMemoryError",
    "UnitPrecision",
    "World",
    "apply_fully_shard",
    "apply_hf_plan",
    "apply_layouts",
    "bind_parallel_modules",
    "bound_modules",
    "describe_problem_codes",
    "from_hf_plan",
    "from_torch_plan",
    "get_family_build_info",
    "parallelize_checked",
    "plan_report",
    "resolve_plan",
    "step_comms",
    "step_memory",
    "step_memory_and_comms",
    "step_time",
    "validate_materialized_modules",
    "validate_parallel_module",
]
