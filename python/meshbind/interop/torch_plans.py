"""torch's ``parallelize_module`` plans: a dict of FQN key → ``ParallelStyle``, resolved
by meshbind with torch's own key semantics and applied by torch on exact FQNs.

torch splits a key on ``.`` and matches each part against one child name with ``fnmatch``
(``*``, ``?``, ``[...]``); braces, ranges and ``**`` mean nothing there. ``from_torch_plan`` writes
each key as the meshbind pattern that selects exactly those modules, one request per key, whose
layout is the placements the style gives the module's parameters on the ``tp`` axis — so
resolution reports every key that selects nothing (with "did you mean"), every module two keys
give different styles, and every weight dimension the ``tp`` size does not divide, at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshbind.agreement import check_ranks_agree, mesh_entries, model_entries, plan_entries
from meshbind.modules import submodule
from meshbind.resolution.plan import ParallelPlan
from meshbind.specs import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec

PROTOCOL = "torch_parallel_style"
"""The protocol of every spec ``from_torch_plan`` makes; its ``options["style"]`` is the style."""


def from_torch_plan(plan: Mapping[str, ParallelStyle]) -> list[NativeParallelBindingRequest]:
    """The requests ``resolve_plan`` takes for a ``parallelize_module`` plan, one per key, in order."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"a torch plan maps FQN keys to ParallelStyle objects, got {type(plan).__name__}")
    requests = []
    for key, style in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"torch plan key {key!r} must be a str")
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"torch plan[{key!r}] must be a ParallelStyle, got {type(style).__name__}")
        spec = ParallelModuleSpec(PROTOCOL, options={"style": style, "key": key}, version=type(style).__name__)
        requests.append(NativeParallelBindingRequest((torch_key_pattern(key),), spec, _layout_of(style)))
    return requests


def torch_key_pattern(key: str) -> str:
    """The meshbind pattern selecting what torch's key selects: each ``.``-part an ``fnmatch`` of
    one FQN segment (a run of ``*`` is one ``*``; ``{ } < > , \\`` are literal)."""
    if key == "":
        return ""
    return ".".join(_segment(part) for part in key.split("."))


_LITERAL = set("{}<>,[]\\")
"""Characters meshbind patterns give a meaning and fnmatch does not (outside a class)."""
_ESCAPE_IN_CLASS = {"\\": "\\\\", "]": "\\]"}


def _segment(part: str) -> str:
    out = []
    index = 0
    while index < len(part):
        char = part[index]
        if char == "*":
            out.append("*")
            while index + 1 < len(part) and part[index + 1] == "*":
                index += 1
        elif char == "?":
            out.append("?")
        elif char == "[" and (close := _class_end(part, index)) is not None:
            body = part[index + 1 : close]
            negated = body.startswith("!")
            body = body[1:] if negated else body
            out.append("[" + ("!" if negated else "") + "".join(_ESCAPE_IN_CLASS.get(c, c) for c in body) + "]")
            index = close
        else:
            out.append("\\" + char if char in _LITERAL else char)
        index += 1
    return "".join(out)


def _class_end(part: str, start: int) -> int | None:
    """Where ``fnmatch`` closes the class opened at ``start`` (``None``: the ``[`` is literal)."""
    index = start + 1
    if index < len(part) and part[index] == "!":
        index += 1
    if index < len(part) and part[index] == "]":  # a leading ] belongs to the class
        index += 1
    close = part.find("]", index)
    return None if close < 0 else close


def style_placements(style: ParallelStyle, module: nn.Module | None) -> dict[str, Placement]:
    """The placement ``style`` gives each of ``module``'s own parameters on its (``tp``) mesh, as
    torch's styles do: colwise shards a Linear's output dim (an Embedding's embedding dim), rowwise
    its input dim (an Embedding's rows); the rest are replicated."""
    names = [] if module is None else [name for name, p in module.named_parameters(recurse=False) if p is not None]
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        weight: Placement = Shard(1) if embedding else Shard(0)
        return {name: weight if name == "weight" else Shard(0) for name in names}
    if isinstance(style, RowwiseParallel):
        weight = Shard(0) if embedding else Shard(1)
        return {name: weight if name == "weight" else Replicate() for name in names}
    if isinstance(style, SequenceParallel):
        return dict.fromkeys(names, Replicate())
    return {}


def _layout_of(style: ParallelStyle) -> Any:
    """The layout provider of a key: the style's placements of each module's parameters on ``tp``."""

    # One layout object per kind of module: validation then checks the layers' modules once.
    layouts: dict[tuple[bool, tuple[str, ...]], ModuleShardingSpec] = {}

    def layout(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        names = () if module is None else tuple(name for name, p in module._parameters.items() if p is not None)
        kind = (isinstance(module, nn.Embedding), names)
        if kind not in layouts:
            layouts[kind] = ModuleShardingSpec(params={name: {"tp": p} for name, p in style_placements(style, module).items()})
        return layouts[kind]

    return layout


def parallelize_checked(
    model: nn.Module, plan: ParallelPlan, tp_mesh: DeviceMesh, group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Apply a resolved torch plan with torch's own ``parallelize_module``, module by module (the
    matching is done: each planned module gets its key's style, once, without torch walking the
    model from the root again for every FQN). The ranks of ``group`` agree first: every rank by
    default, a pipeline stage's (``MeshContext.stage_group``) when the model is one stage."""
    # The ranks agree on the mesh tp_mesh is cut from, as apply_fully_shard does on the same plan.
    root = tp_mesh._get_root_mesh()
    check_ranks_agree(
        "parallelize_checked",
        lambda: [*model_entries(model, plan.index), *plan_entries(plan), *mesh_entries(root)],
        model=model,
        group=group,
    )
    styled = [
        (submodule(model, fqn), spec.options["style"]) for fqn, spec in plan.parallel_modules.items() if spec.protocol == PROTOCOL
    ]
    for module, style in styled:
        parallelize_module(module, tp_mesh, style)
    return model
