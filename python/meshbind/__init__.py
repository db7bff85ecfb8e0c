"""meshbind: resolve, validate and bind large-model parallel plans onto PyTorch module trees.

``__all__`` lists what users call and the errors they catch. The results those calls return
(``ParallelPlan``, ``PlanProblem``, ``ModuleTree``, ``IndexMatches``, ``BoundModule``,
``FamilyBuildInfo``, ``FamilyLayout``, ``RoutedTokens``) are importable from here too, for type
hints, but are not entry points.
"""

from importlib import metadata

from meshbind._core import IndexMatches as IndexMatches
from meshbind._core import ModuleTree as ModuleTree
from meshbind._core import PatternSet
from meshbind.binding import BoundModule as BoundModule
from meshbind.binding import ParallelBinding, bind_parallel_modules, bound_modules, validate_materialized_modules
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
from meshbind.interop.torch_plans import from_torch_plan, parallelize_checked
from meshbind.layouts import apply_layouts
from meshbind.memory.result import StepMemory as StepMemory
from meshbind.memory.routing import Routing
from meshbind.memory.trace import step_memory
from meshbind.mesh import MeshBinding, MeshContext
from meshbind.report import PlanReport as PlanReport
from meshbind.report import plan_report
from meshbind.resolution import ParallelPlan as ParallelPlan
from meshbind.resolution import resolve_plan
from meshbind.specs import FullyShard, LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec
from meshbind.validation import validate_parallel_module
from meshbind.world import World

_HUGGING_FACE = ("from_hf_plan", "apply_hf_plan")
"""Entry points that import transformers (the ``hf`` extra): loaded on first use."""


def __getattr__(name: str) -> object:
    if name in _HUGGING_FACE:
        from meshbind.interop import hf_plans

        return getattr(hf_plans, name)
    raise AttributeError(f"module 'meshbind' has no attribute {name!r}")


try:
    __version__ = metadata.version("meshbind")
except metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "unknown"

__all__ = [
    "BindingError",
    "BindingRefusedError",
    "CPContext",
    "CheckpointError",
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
    "step_memory",
    "validate_materialized_modules",
    "validate_parallel_module",
]
