"""Activation checkpointing as torchtitan applies it, before FSDP: torch's ``checkpoint_wrapper``
on each block (each outermost FSDP unit below the root, else each member of the model's layer
list), on every K-th of them only (``selective-layer:K``), or on each block with torch's selective
checkpointing (``selective-op``), which keeps the outputs of a save list of operators and
recomputes the rest.

``selective-op`` keeps torchtitan's save list: matrix products, attention, the reduce-scatter of
a functional collective and ``max``; of the matrix products, every second one is recomputed (the
count restarts with each block, and again for its recomputation, so both agree). The list also
names the CPU's own attention kernel: the step a CPU trace or measurement runs saves its attention
as a CUDA step saves its flash or efficient attention.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshbind.errors import StepMemoryError
from meshbind.model_index import index_of
from meshbind.modules import submodule
from meshbind.names import ActivationCheckpointing, Checkpointing
from meshbind.resolution.plan import ParallelPlan

_ops = torch.ops.aten
SAVED_OPERATORS = frozenset(
    {
        _ops.mm.default,
        _ops._scaled_dot_product_efficient_attention.default,
        _ops._scaled_dot_product_flash_attention.default,
        _ops._scaled_dot_product_cudnn_attention.default,
        _ops._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        _ops.max.default,
    }
)
"""The operators whose outputs ``selective-op`` saves (every second ``mm`` excepted)."""

RecomputeContext = Callable[[], contextlib.AbstractContextManager[Any]]


def apply_checkpointing(
    model: nn.Module, plan: ParallelPlan, checkpointing: Checkpointing, recompute_context: RecomputeContext | None = None
) -> list[str]:
    """Wraps the blocks ``checkpointing`` names in place; returns their FQNs. ``recompute_context()``,
    when given, is entered around each wrapped block's forward and its recomputation (torch's
    ``context_fn``), outside the selective checkpointing's own modes."""
    if checkpointing.mode is ActivationCheckpointing.NONE:
        return []
    blocks = checkpoint_units(model, plan)
    if checkpointing.mode is ActivationCheckpointing.SELECTIVE_LAYER:
        blocks = blocks[checkpointing.every - 1 :: checkpointing.every]  # torchtitan's K-th, 2K-th, ... block
    selective = checkpointing.mode is ActivationCheckpointing.SELECTIVE_OP
    wrapping: dict[str, Any] = {}
    if selective or recompute_context is not None:
        wrapping["context_fn"] = lambda: _contexts(selective, recompute_context)
    for fqn in blocks:
        parent_fqn, _, name = fqn.rpartition(".")
        parent = submodule(model, parent_fqn)
        block = parent._modules[name]
        assert block is not None
        # torchtitan's choice: no RNG state saved per block (its models have no dropout to replay)
        setattr(parent, name, checkpoint_wrapper(block, preserve_rng_state=False, **wrapping))
    return blocks


def checkpoint_units(model: nn.Module, plan: ParallelPlan) -> list[str]:
    """The blocks: each FSDP unit below the root that no other such unit contains (a transformer
    block, not also its experts inside it); without FSDP units, each module of the model's longest
    ``ModuleList`` (its blocks, as torchtitan wraps them); none in a pipeline stage without blocks."""
    if plan.fsdp is not None:
        fqns = sorted(unit.fqn for unit in plan.fsdp.units if unit.fqn)
        outermost: list[str] = []
        for fqn in fqns:  # sorted: a unit comes right after any unit holding it
            if not outermost or not fqn.startswith(outermost[-1] + "."):
                outermost.append(fqn)
        if outermost:
            return outermost
    blocks = index_of(model, plan.index).layer_list()
    if blocks is None and plan.context.world.pp > 1:
        return []  # a pipeline stage of the embedding or the head alone holds no block
    if blocks is None:
        raise StepMemoryError(
            f"activation checkpointing wraps the FSDP units or the blocks of a ModuleList: {type(model).__name__} has neither"
        )
    return [f"{blocks}.{name}" if blocks else name for name in submodule(model, blocks)._modules]


def _contexts(
    selective: bool, recompute_context: RecomputeContext | None
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """The forward's and the recomputation's contexts of one checkpointed call."""
    if not selective:
        assert recompute_context is not None
        return recompute_context(), recompute_context()
    forward, recompute = create_selective_checkpoint_contexts(_every_second_mm_recomputed())  # type: ignore[no-untyped-call]
    if recompute_context is None:
        return forward, recompute
    return _Nested(recompute_context(), forward), _Nested(recompute_context(), recompute)


def _every_second_mm_recomputed() -> Callable[..., CheckpointPolicy]:
    """torchtitan's policy: save the listed operators' outputs, but recompute every second ``mm``
    (counted apart in the forward and in the recomputation, so that both pick the same ones)."""
    mm_counts: defaultdict[bool, int] = defaultdict(int)

    def policy(context: Any, operator: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if operator == _ops.mm.default:
            mm_counts[context.is_recompute] += 1
            if mm_counts[context.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if operator in SAVED_OPERATORS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Nested:
    """``outer`` around ``inner``, both kept as long as this is: torch keeps a block's recomputation
    context until the block's backward ends, and with it the selective checkpointing's cache of
    outputs the recomputation stopped before (a generator would drop them when it exits)."""

    def __init__(self, outer: contextlib.AbstractContextManager[Any], inner: contextlib.AbstractContextManager[Any]) -> None:
        self.outer = outer
        self.inner = inner

    def __enter__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.outer)
        self.stack.enter_context(self.inner)

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self.stack.__exit__(*exc_info)
