"""meshbind: resolve, validate and bind large-model parallel plans onto PyTorch module trees."""

from importlib import metadata

from meshbind._core import IndexMatches, ModuleTree, PatternError, PatternSet
from meshbind.binding import (
    BindingError,
    BoundModule,
    MaterializationError,
    ParallelBinding,
    bind_parallel_modules,
    bound_modules,
    validate_materialized_modules,
)
from meshbind.cp import CPContext
from meshbind.ep import EPContext, RoutedTokens
from meshbind.family import FamilyBuildInfo, FamilyLayout, get_family_build_info
from meshbind.mesh import MeshBinding, MeshContext
from meshbind.plan import ParallelPlan, PlanError, PlanProblem, resolve_plan
from meshbind.specs import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec
from meshbind.validation import validate_parallel_module

try:
    __version__ = metadata.version("meshbind")
except metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "unknown"

__all__ = [
    "BindingError",
    "BoundModule",
    "CPContext",
    "EPContext",
    "FamilyBuildInfo",
    "FamilyLayout",
    "IndexMatches",
    "LayoutContext",
    "MaterializationError",
    "MeshBinding",
    "MeshContext",
    "ModuleShardingSpec",
    "ModuleTree",
    "NativeParallelBindingRequest",
    "ParallelBinding",
    "ParallelModuleSpec",
    "ParallelPlan",
    "PatternError",
    "PatternSet",
    "PlanError",
    "PlanProblem",
    "RoutedTokens",
    "bind_parallel_modules",
    "bound_modules",
    "get_family_build_info",
    "resolve_plan",
    "validate_materialized_modules",
    "validate_parallel_module",
]
