"""Alike layers traced once: a model whose blocks end in a run of alike ones (a transformer's
decoder layers) is traced at three, four and five blocks of that run, and its step at full depth
extrapolated from them, only where that is exact.

Exact means: at every place of the step (the module running, the phase and the last block run in
it, so that the root's moments before, between and after the blocks are apart), the most bytes live
there and each kind then grow by the same number of bytes from three blocks to four as from four
to five. A block's parameters, gradients, optimizer state, saved activations and sharded FSDP
state then each add the same bytes, and what is live only around one block (its gathered
parameters, its backward's temporaries) adds none; every place's full-depth figures follow, and
the highest is the peak. Every place, not only where the shallow steps peak: bytes that grow
faster with depth (each checkpointed block's saved input, all the optimizer's state) overtake a
shallow step's peak in a deep one. The shallowest depth is three: with fewer, FSDP's prefetching
and the first and last blocks' edges make the steps differ. Where a place's steps differ, the
whole model is traced.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from torch import nn

from meshbind.memory.trackers import Place
from meshbind.model_index import ModelIndex, ParameterKind
from meshbind.resolution.plan import ParallelPlan

TRACED_DEPTHS = (3, 4, 5)
"""Blocks of the alike run kept in the three traces."""


@dataclass(frozen=True)
class AlikeRun:
    """The last blocks of the model's longest ``ModuleList`` that are alike: ``count`` of them from
    index ``first`` to the end of the list at ``list_fqn``."""

    list_fqn: str
    first: int
    count: int

    def extrapolated_text(self) -> str:
        """How a trace extrapolated from it: ``3, 4 and 5 of the 126 alike blocks of model.layers, ...``."""
        depths = ", ".join(map(str, TRACED_DEPTHS[:-1])) + f" and {TRACED_DEPTHS[-1]}"
        return f"{depths} of the {self.count} alike blocks of {self.list_fqn}, extrapolated (exact)"


def alike_run(index: ModelIndex) -> AlikeRun | None:
    """The run of alike blocks worth tracing at three depths (more blocks than the deepest), or ``None``."""
    list_fqn = index.layer_list()
    if list_fqn is None:
        return None
    signatures = _signatures(index, list_fqn)
    first = len(signatures) - 1
    while first > 0 and signatures[first - 1] == signatures[-1]:
        first -= 1
    count = len(signatures) - first
    return AlikeRun(list_fqn, first, count) if count > TRACED_DEPTHS[-1] else None


def _signatures(index: ModelIndex, list_fqn: str) -> list[tuple[object, ...]]:
    """Each block of the list, told apart by what makes blocks alike: the classes of its modules
    and its parameters (names within the block, shapes, dtypes, ``requires_grad``), in order.
    One pass over the index's modules and one over its parameters."""
    prefix = f"{list_fqn}." if list_fqn else ""
    length = dict(index.module_lists)[list_fqn]
    classes: list[list[type]] = [[] for _ in range(length)]
    parameters: list[list[tuple[str, ParameterKind]]] = [[] for _ in range(length)]
    for fqn, cls in zip(index.module_fqns, index.module_classes, strict=True):
        if (block := _block_of(fqn, prefix)) is not None and block[0] < length:
            classes[block[0]].append(cls)
    for fqn, kind in index.parameters():
        if (block := _block_of(fqn, prefix)) is not None and block[0] < length:
            parameters[block[0]].append((block[1], kind))
    return [(tuple(c), tuple(p)) for c, p in zip(classes, parameters, strict=True)]


def _block_of(fqn: str, prefix: str) -> tuple[int, str] | None:
    """The index of the block ``fqn`` lies in (the list's FQN and a dot are ``prefix``) and its
    name within the block, ``None`` outside the list's blocks."""
    if not fqn.startswith(prefix):
        return None
    number, _, rest = fqn[len(prefix) :].partition(".")
    return (int(number), rest) if number.isdigit() else None


def kept_modules(run: AlikeRun, kept: int) -> Callable[[str], bool]:
    """Whether a module of the whole model is in its copy keeping ``kept`` blocks of the run."""
    prefix = f"{run.list_fqn}." if run.list_fqn else ""
    end = run.first + kept

    def keep(fqn: str) -> bool:
        block = _block_of(fqn, prefix)
        return block is None or block[0] < end

    return keep


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


def depth_copies(
    deepest: nn.Module, plan: ParallelPlan, index: ModelIndex, run: AlikeRun
) -> Iterator[tuple[nn.Module, ParallelPlan]]:
    """The model at each traced depth (each a copy of ``deepest``, the copy keeping the most
    blocks) and the plan of the modules it keeps, ``index`` (the whole model's) cut to it."""
    for kept in TRACED_DEPTHS:
        model, keep = truncated(deepest, run, kept), kept_modules(run, kept)
        yield model, replace(plan.only(keep), index=index.restricted(model, keep))


def extrapolated(places: Sequence[Mapping[Place, Mapping[str, int]]], run: AlikeRun) -> tuple[Place, dict[str, int]] | None:
    """The place of the full-depth step's peak and its figures, from each place's figures at the
    traced depths (``Peak.places``), or ``None`` when some place's figures do not grow by equal
    steps (extrapolating would not be exact). Every place is extrapolated, not only where the
    traced steps peak: a place whose bytes grow faster with depth (saved activations, at the start
    of a checkpointed backward) overtakes a shallow step's peak in a deep one."""
    named = [_full_depth_names(at_depth, run, depth) for at_depth, depth in zip(places, TRACED_DEPTHS, strict=True)]
    best: tuple[Place, dict[str, int]] | None = None
    for place, one in named[0].items():
        if place not in named[1] or place not in named[2]:
            continue
        two, three = named[1][place], named[2][place]
        step = {key: two[key] - one[key] for key in one}
        if any(three[key] - two[key] != step[key] for key in one):
            return None
        full = {key: one[key] + (run.count - TRACED_DEPTHS[0]) * step[key] for key in one}
        if best is None or full["peak"] > best[1]["peak"]:
            best = (place, full)
    return best


def _full_depth_names(places: Mapping[Place, Mapping[str, int]], run: AlikeRun, depth: int) -> dict[Place, Mapping[str, int]]:
    """A traced step's places named as in the whole model: a block of the run among its first
    three is counted from the run's start and one among its last three from its end, so that each
    is one place at every depth. The last block is not counted from the start, nor the first from
    the end: an edge block steps differently (nothing after it to prefetch or reduce beside), and
    at three blocks the third is the last. A place's module and the last block it follows are in
    one block when the module is in one; else the last block alone is renamed."""
    prefix = f"{run.list_fqn}." if run.list_fqn else ""
    named: dict[Place, Mapping[str, int]] = {}
    for (module, phase, after), figures in places.items():
        anchor = _block_of(module, prefix) or _block_of(after, prefix)
        if anchor is None or anchor[0] < run.first:
            named[(module, phase, after)] = figures
            continue
        position = anchor[0] - run.first
        renumbered = []
        if position < min(TRACED_DEPTHS[0], depth - 1):
            renumbered.append(run.first + position)
        if max(depth - TRACED_DEPTHS[0], 1) <= position:
            renumbered.append(run.first + run.count - (depth - position))
        for number in renumbered:
            named[(_renumbered(module, prefix, number), phase, _renumbered(after, prefix, number))] = figures
    return named


def _renumbered(fqn: str, prefix: str, number: int) -> str:
    """``fqn`` in block ``number`` of the run, if it is in a block of it; else as it is."""
    block = _block_of(fqn, prefix)
    if block is None:
        return fqn
    return f"{prefix}{number}.{block[1]}" if block[1] else f"{prefix}{number}"
