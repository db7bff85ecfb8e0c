"""Alike layers traced once: a model whose blocks end in a run of alike ones (a transformer's
decoder layers) is traced at three, four and five blocks of that run, and its step at full depth
extrapolated from them, only where that is exact.

Exact means: every figure (the peak and each kind live at it) grows by the same number of bytes
from three blocks to four as from four to five. A block's parameters, gradients, optimizer state,
saved activations and sharded FSDP state then each add the same bytes, and what is live only
around one block (its gathered parameters, its backward's temporaries) adds none; the full-depth
figures follow. The shallowest depth is three: with fewer, FSDP's prefetching and the first and
last blocks' edges make the steps differ. Where the steps differ, the whole model is traced.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

TRACED_DEPTHS = (3, 4, 5)
"""Blocks of the alike run kept in the three traces."""


@dataclass(frozen=True)
class AlikeRun:
    """The last blocks of the model's longest ``ModuleList`` that are alike: ``count`` of them from
    index ``first`` to the end of the list at ``list_fqn``."""

    list_fqn: str
    first: int
    count: int

    def full_name(self, deeper: str, shallower: str) -> str:
        """The module the deepest trace's peak fell in, named as in the whole model. A block whose
        index did not move from the trace one block shallower is counted from the start (the peak
        stays with it at any depth); one that moved with the depth, from the end."""
        prefix = f"{self.list_fqn}." if self.list_fqn else ""
        index, shallower_index = _block_index(deeper, prefix), _block_index(shallower, prefix)
        if index is None or index == shallower_index:
            return deeper
        rest = deeper[len(prefix) + len(str(index)) :]
        return f"{prefix}{index + self.count - TRACED_DEPTHS[-1]}{rest}"


def _block_index(module: str, prefix: str) -> int | None:
    if not module.startswith(prefix):
        return None
    index = module[len(prefix) :].partition(".")[0]
    return int(index) if index.isdigit() else None


def alike_run(model: nn.Module) -> AlikeRun | None:
    """The run of alike blocks worth tracing at three depths (more blocks than the deepest), or ``None``."""
    lists = [(fqn, module) for fqn, module in model.named_modules() if isinstance(module, nn.ModuleList) and len(module)]
    if not lists:
        return None
    fqn, blocks = max(lists, key=lambda item: len(item[1]))
    signatures = [_signature(block) for block in blocks]
    first = len(signatures) - 1
    while first > 0 and signatures[first - 1] == signatures[-1]:
        first -= 1
    count = len(signatures) - first
    return AlikeRun(fqn, first, count) if count > TRACED_DEPTHS[-1] else None


def _signature(block: nn.Module) -> tuple[object, ...]:
    """Blocks are alike when their classes and parameters (names, shapes, dtypes) are."""
    parameters = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters())
    return (type(block), parameters, tuple(type(module) for module in block.modules()))


def truncated(model: nn.Module, run: AlikeRun, kept: int) -> nn.Module:
    """A copy of ``model`` keeping the blocks before the run and ``kept`` blocks of it."""
    parent_fqn, _, name = run.list_fqn.rpartition(".")
    parent = model.get_submodule(parent_fqn)
    blocks = parent._modules[name]
    assert isinstance(blocks, nn.ModuleList)
    # The copy is made of the blocks kept only: the rest of a full model on meta is not copied.
    parent._modules[name] = nn.ModuleList(list(blocks)[: run.first + kept])
    try:
        return copy.deepcopy(model)
    finally:
        parent._modules[name] = blocks


def extrapolated(figures: Sequence[Mapping[str, int]], count: int) -> dict[str, int] | None:
    """The figures at ``count`` blocks from those at the traced depths, or ``None`` when they do not
    grow by equal steps (extrapolating would not be exact)."""
    one, two, three = figures
    step = {key: two[key] - one[key] for key in one}
    if any(three[key] - two[key] != step[key] for key in one):
        return None
    return {key: one[key] + (count - TRACED_DEPTHS[0]) * step[key] for key in one}
