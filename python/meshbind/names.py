"""meshbind's vocabulary: each closed set of names that crosses a boundary (the command line's
choices, the JSON, the report, the trace) as one enum. A member is its own text (``str``), so
JSON, messages and comparisons with plain strings read it as written. ``PlacementKind`` is the
Rust core's own enum: the checks take its members as they are, never text parsed again."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import TypeVar

from meshbind._core import PlacementKind as PlacementKind

NameT = TypeVar("NameT", bound="Name")


class Name(str, Enum):
    """A closed set of names; ``parse`` is how text from a user becomes one."""

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:  # messages quote a name as written: 'tp', not <Axis.TP: 'tp'>
        return repr(self.value)

    @classmethod
    def parse(cls: type[NameT], value: object, what: str) -> NameT:
        """``value`` as a member, or a ValueError naming ``what`` and every choice."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {', '.join(cls.choices())}, got {value!r}") from None

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class Axis(Name):
    """The world's axes, as torchtitan names its mesh dims: ``pp`` outermost, the device mesh's
    (outermost first), then ``ep``, and the expert mesh's data-parallel axes derived from them."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    EP = "ep"
    EDP_REPLICATE = "edp_replicate"
    EDP_SHARD = "edp_shard"


class MeshSide(Name):
    """Which prebuilt mesh a parameter or an FSDP unit lives on: the device mesh, or the expert
    mesh over the same ranks."""

    DEVICE = "device"
    EXPERT = "expert"


class Optimizer(Name):
    """Whose state the report counts and the trace steps."""

    NONE = "none"
    SGD_MOMENTUM = "sgd-momentum"
    ADAM = "adam"
    ADAM_FP32_MASTER = "adam-fp32-master"


class ActivationCheckpointing(Name):
    """What a step keeps for backward, as torchtitan's modes: everything (``none``); each block's
    input only (``full``: torch's ``checkpoint_wrapper`` on each FSDP unit or block); so on every
    K-th block only (``selective-layer:K``); or, in every block, the outputs of a save list of
    operators (``selective-op``: torch's selective checkpointing)."""

    NONE = "none"
    FULL = "full"
    SELECTIVE_LAYER = "selective-layer"
    SELECTIVE_OP = "selective-op"


@dataclass(frozen=True)
class Checkpointing:
    """An activation-checkpointing choice: its mode, and for ``selective-layer`` which blocks
    (every ``every``-th). Its text is what the command line and the JSON write
    (``selective-layer:2``)."""

    mode: ActivationCheckpointing
    every: int = 1

    def __str__(self) -> str:
        return f"{self.mode}:{self.every}" if self.mode is ActivationCheckpointing.SELECTIVE_LAYER else str(self.mode)

    @staticmethod
    def parse(value: object, what: str) -> Checkpointing:
        """``value`` (a ``Checkpointing``, or its text) as a choice; anything else is a
        ValueError naming ``what`` and the forms it takes."""
        if isinstance(value, Checkpointing):
            return value
        if isinstance(value, str):
            mode, colon, every = value.partition(":")
            layer = ActivationCheckpointing.SELECTIVE_LAYER
            if colon and mode == layer and every.isdecimal() and every.isascii() and 1 <= int(every) <= 2**31 - 1:
                return Checkpointing(layer, int(every))
            if not colon and mode in ActivationCheckpointing.choices() and mode != layer:
                return Checkpointing(ActivationCheckpointing(mode))
        forms = "none, full, selective-layer:K (K a whole number from 1), selective-op"
        raise ValueError(f"{what} must be one of {forms}, got {value!r}")


class Device(Name):
    """The device a traced step runs on."""

    CUDA = "cuda"
    CPU = "cpu"


DTYPE_NAMES: Mapping[str, str] = MappingProxyType(
    {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32", "float32": "float32"}
)
"""The dtypes mixed precision takes by name (``FullyShard``, ``--param-dtype``), as torchtitan and
people write them, each to its ``torch`` attribute."""
