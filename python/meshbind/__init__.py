"""meshbind: resolve, validate and bind large-model parallel plans onto PyTorch module trees."""

from meshbind._core import ModuleTree, PatternError, PatternSet
from meshbind.family import FamilyBuildInfo, FamilyLayout, get_family_build_info
from meshbind.plan import ParallelPlan, PlanError, PlanProblem, resolve_plan
from meshbind.specs import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec
from meshbind.validation import validate_parallel_module

__all__ = [
    "FamilyBuildInfo",
    "FamilyLayout",
    "LayoutContext",
    "ModuleShardingSpec",
    "ModuleTree",
    "NativeParallelBindingRequest",
    "ParallelModuleSpec",
    "ParallelPlan",
    "PatternError",
    "PatternSet",
    "PlanError",
    "PlanProblem",
    "get_family_build_info",
    "resolve_plan",
    "validate_parallel_module",
]
