"""Per-module validation: the rules (``rules.py``) and the batch that runs them over a
whole plan, placement arithmetic in Rust (``batch.py``)."""

from __future__ import annotations

from torch import nn

from meshbind.specs import LayoutContext, ModuleShardingSpec, ParallelModuleSpec
from meshbind.validation.batch import ValidationBatch
from meshbind.validation.rules import class_failure, sharding_failure

__all__ = ["ValidationBatch", "validate_parallel_module"]


def validate_parallel_module(
    module: nn.Module, parallel: ParallelModuleSpec, sharding: ModuleShardingSpec, context: LayoutContext
) -> None:
    """The per-module rules for one module: raises ``ValueError`` at the first failure.

    The order is rules 1-4, then the module's ``layout`` checks, then rule 5, then ``validate``.
    """
    _require(module, nn.Module, "module")
    _require(parallel, ParallelModuleSpec, "parallel")
    _require(sharding, ModuleShardingSpec, "sharding")
    _require(context, LayoutContext, "context")
    failure = class_failure(type(module), parallel) or sharding_failure(sharding)
    if failure is None:
        problems = ValidationBatch(context).check([module], [""], [parallel], [sharding], rules_1_to_4_passed=True)
        failure = (problems[0][1], problems[0][2]) if problems else None
    if failure is not None:
        code, message = failure
        raise ValueError(f"[{code}] {type(module).__qualname__}: {message}")


def _require(value: object, kind: type, name: str) -> None:
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
