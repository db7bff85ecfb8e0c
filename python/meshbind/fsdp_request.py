"""What a plan asks of torch's FSDP2: its units (``FullyShard``) and their mixed precision, the
plan's and a unit's own (``UnitPrecision``), checked for form only; resolution finds the units
and every problem of them (``resolution/fsdp.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshbind._core import check_patterns
from meshbind.names import DTYPE_NAMES
from meshbind.specs import _set


@dataclass(frozen=True)
class FullyShard:
    """Where torch's FSDP2 (``fully_shard``) groups the parameters: one unit per module
    each pattern selects, applied bottom-up (deeper modules first, then in the order given), then
    the root, as torchtitan wraps its blocks. ``units=None`` takes torchtitan's default units
    (each block of the model's layer list, each module holding expert parameters, the root). A
    unit holding expert parameters (placed on ``ep``) shards over the expert mesh's
    ``edp_shard``; any other over ``dp_shard · cp``; both replicate over ``dp_replicate`` (HSDP)
    when it is above 1. ``reshard_after_forward`` is ``fully_shard``'s own (``None``: torch's
    default, every unit but the root; under a pipeline, ``pp`` above 1, torchtitan's: none, so
    that a stage's microbatches reuse the gathered weights).

    Mixed precision is torch's ``MixedPrecisionPolicy`` on every unit, with its names and
    defaults: ``param_dtype`` (what a unit is all-gathered and computed in), ``reduce_dtype``
    (what its gradients are reduced in), ``output_dtype`` and ``cast_forward_inputs``; ``None``
    keeps the parameter's own dtype. A dtype is a floating ``torch.dtype`` or its name as
    torchtitan writes it (``"bfloat16"``, ``"float32"``, ``"float16"``; ``"bf16"``, ``"fp32"``,
    ``"fp16"``). ``unit_policies`` gives the units a pattern selects a policy of their own
    (``UnitPrecision``: a router kept in float32 under a bfloat16 plan)."""

    units: tuple[str, ...] | None
    reshard_after_forward: bool | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    unit_policies: tuple[UnitPrecision, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.units, str):
            raise ValueError(f"FullyShard.units must be a tuple of patterns, not a bare str: write ({self.units!r},)")
        if self.units is not None:
            if not isinstance(self.units, Sequence) or not all(isinstance(pattern, str) for pattern in self.units):
                raise ValueError(f"FullyShard.units must be a tuple of pattern strings or None, got {self.units!r}")
            _set(self, "units", tuple(self.units))
            check_patterns(self.units)
        if self.reshard_after_forward is not None and not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"FullyShard.reshard_after_forward must be a bool or None, got {self.reshard_after_forward!r}")
        _check_precision(self, "FullyShard")
        if isinstance(self.unit_policies, UnitPrecision) or not isinstance(self.unit_policies, Sequence):
            raise ValueError(f"FullyShard.unit_policies must be a tuple of UnitPrecision, got {self.unit_policies!r}")
        for index, unit_policy in enumerate(self.unit_policies):
            if not isinstance(unit_policy, UnitPrecision):
                raise ValueError(f"FullyShard.unit_policies[{index}] must be a UnitPrecision, got {unit_policy!r}")
        _set(self, "unit_policies", tuple(self.unit_policies))

    @property
    def mixed_precision(self) -> bool:
        """Whether any dtype of the policy is set (else ``fully_shard`` keeps every parameter's own)."""
        return any(dtype is not None for dtype in (self.param_dtype, self.reduce_dtype, self.output_dtype))


@dataclass(frozen=True)
class UnitPrecision:
    """The mixed-precision policy of the FSDP units ``units`` selects, in place of the plan's
    (``FullyShard.unit_policies``): torch's ``MixedPrecisionPolicy`` fields, with its defaults.
    A router or norm kept in float32 under a bfloat16 plan is a unit of its own with
    ``param_dtype=torch.float32`` (its inputs are cast to it, ``cast_forward_inputs``)."""

    units: str
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.units, str):
            raise ValueError(f"UnitPrecision.units must be one pattern str, got {self.units!r}")
        check_patterns([self.units])
        _check_precision(self, "UnitPrecision")


def _check_precision(policy: FullyShard | UnitPrecision, owner: str) -> None:
    """The policy fields read as torch takes them (a dtype's name becomes the dtype); a wrong one
    is a ``ValueError`` naming ``owner.field``."""
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        _set(policy, name, floating_dtype(f"{owner}.{name}", getattr(policy, name)))
    if not isinstance(policy.cast_forward_inputs, bool):
        raise ValueError(f"{owner}.cast_forward_inputs must be a bool, got {policy.cast_forward_inputs!r}")


def floating_dtype(field_name: str, value: object) -> torch.dtype | None:
    """``value`` as a floating ``torch.dtype`` (``None`` stays ``None``); anything else is a
    ``ValueError`` naming the field and the names it takes."""
    if value is None:
        return None
    if isinstance(value, str) and value in DTYPE_NAMES:
        return getattr(torch, DTYPE_NAMES[value])  # type: ignore[no-any-return]
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    raise ValueError(f"{field_name} must be a floating torch.dtype or one of {', '.join(DTYPE_NAMES)}, got {value!r}")
