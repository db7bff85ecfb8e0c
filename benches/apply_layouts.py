"""Applying layouts, and then FSDP2, against what a torch user writes today for the same placements.

    python benches/apply_layouts.py --layers 61 --experts 256 --world-size 4

Every rank of a local gloo world (``tp`` over two ranks, ``dp_shard`` over the rest, ``ep`` over
all of them) builds the demo's ``MoETransformer`` on ``meta`` and times, side by side on fresh models:

- ``meshbind``: ``apply_layouts`` of a resolved plan — attention ``qkv`` ``Shard(0)`` and ``out``
  ``Shard(1)`` on ``tp``, the fused expert weights ``Shard(0)`` and the router ``Replicate`` on
  ``ep`` — every placement checked before any parameter changes;
- ``meshbind_unchecked``: the same without the check that the ranks agree (the difference is its cost);
- ``torch``: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` for the
  attention projections and ``distribute_module`` with ``Shard(0)`` for the experts' weights;
- ``meshbind_fsdp``: ``apply_layouts`` then ``apply_fully_shard`` of a plan with FSDP units (each
  layer's experts on the expert mesh, each block, the root), every check included;
- ``torch_fsdp``: ``torch``'s path, then ``fully_shard`` per unit on the same meshes, as torchtitan
  wraps them.

Each pair must leave every parameter a ``DTensor`` with the same placements and local shape (the
run fails otherwise). A method's time is the median over ``--repeat`` runs on its slowest rank;
``x meshbind`` is against ``meshbind`` (``meshbind_fsdp`` for the FSDP rows).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from meshbind import (
    FullyShard,
    MeshContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    agreement,
    apply_fully_shard,
    apply_layouts,
    resolve_plan,
)
from meshbind.examples.cp_attention import CPAttention
from meshbind.examples.moe_layer import MoELayer, moe_layer_class
from meshbind.examples.moe_transformer import DecoderBlock, MoETransformer, TransformerConfig
from meshbind.launch import run_local_world
from meshbind.specs import LayoutContext

from timing import timed_on_fresh

METHODS = ("meshbind", "meshbind_unchecked", "torch", "meshbind_fsdp", "torch_fsdp")
"""``meshbind_unchecked``: ``apply_layouts`` with the ranks' agreement check off
(``MESHBIND_NO_RANK_CHECK=1``), so the same run shows what the check costs."""
REFERENCE = {"meshbind_fsdp": "meshbind_fsdp", "torch_fsdp": "meshbind_fsdp"}
"""The method each one is compared with (the rest: ``meshbind``)."""
UNITS = FullyShard(("blocks.*.moe", "blocks.*"))


def _attention_tp(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    return ModuleShardingSpec(params={"qkv.weight": {"tp": Shard(0)}, "out.weight": {"tp": Shard(1)}})


def _experts_ep(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    # The router too: distribute_module replicates every parameter its partition_fn leaves.
    params: dict[str, dict[str, Any]] = {name: {"ep": Shard(0)} for name in MoELayer.EXPERT_WEIGHTS}
    return ModuleShardingSpec(params={**params, "router.weight": {"ep": Replicate()}})


def _requests(config: TransformerConfig) -> list[NativeParallelBindingRequest]:
    """The family classes' own specs with these layouts (a request giving a family its own spec wins)."""
    return [
        NativeParallelBindingRequest(("blocks.*.attn",), CPAttention.parallel_spec, _attention_tp),
        NativeParallelBindingRequest(("blocks.*.moe",), moe_layer_class(config.experts).parallel_spec, _experts_ep),
    ]


def _torch(model: MoETransformer, mesh_context: MeshContext) -> None:
    tp = mesh_context.device_mesh["tp"]
    ep = mesh_context.fsdp_moe_mesh["ep"]  # type: ignore[index]
    plan = {"blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.out": RowwiseParallel()}
    parallelize_module(model, tp, plan)

    def experts(name: str, module: nn.Module, mesh: Any) -> None:
        if not isinstance(module, MoELayer):  # distribute_module hands over every submodule
            return
        for weight in MoELayer.EXPERT_WEIGHTS:
            module.register_parameter(weight, nn.Parameter(distribute_tensor(getattr(module, weight), mesh, [Shard(0)])))

    for block in cast(list[DecoderBlock], model.blocks):
        distribute_module(block.moe, ep, experts)


def _torch_fsdp(model: MoETransformer, mesh_context: MeshContext) -> None:
    _torch(model, mesh_context)
    experts, dense = mesh_context.fsdp_moe_mesh["edp_shard"], mesh_context.device_mesh["dp_shard"]  # type: ignore[index]
    for block in cast(list[DecoderBlock], model.blocks):
        fully_shard(block.moe, mesh=experts)
    for block in cast(list[DecoderBlock], model.blocks):
        fully_shard(block, mesh=dense)
    fully_shard(model, mesh=dense)


def _meshbind_fsdp(model: MoETransformer, plan: Any, mesh_context: MeshContext) -> None:
    apply_layouts(model, plan, mesh_context)
    apply_fully_shard(model, plan, mesh_context)


def _placed(model: MoETransformer) -> list[tuple[str, tuple[Any, ...], tuple[int, ...]]]:
    """Every distributed parameter: its FQN, placements and local shape."""
    return [
        (name, tuple(p.placements), tuple(p.to_local().shape)) for name, p in model.named_parameters() if isinstance(p, DTensor)
    ]


def _timed(config: TransformerConfig, method: Callable[[MoETransformer], object], repeat: int) -> tuple[float, list[Any]]:
    def fresh() -> MoETransformer:
        with torch.device("meta"):
            return MoETransformer(config)

    median, placed = timed_on_fresh(fresh, method, _placed, repeat, torch.distributed.barrier)
    return median, placed[-1]


def rank_timings(layers: int, experts: int, repeat: int) -> dict[str, tuple[float, list[Any]]]:
    world = torch.distributed.get_world_size()
    mesh_context = MeshContext.build(dp_shard=world // 2, cp=1, tp=2, ep=world)
    config = TransformerConfig(layers=layers, experts=experts)
    with torch.device("meta"):
        plan = resolve_plan(MoETransformer(config), _requests(config), mesh_context.layout_context())
        sharded = resolve_plan(MoETransformer(config), _requests(config), mesh_context.layout_context(), fully_shard=UNITS)
    return {
        "meshbind": _timed(config, lambda model: apply_layouts(model, plan, mesh_context), repeat),
        "meshbind_unchecked": _timed(config, lambda model: _unchecked(model, plan, mesh_context), repeat),
        "torch": _timed(config, lambda model: _torch(model, mesh_context), repeat),
        "meshbind_fsdp": _timed(config, lambda model: _meshbind_fsdp(model, sharded, mesh_context), repeat),
        "torch_fsdp": _timed(config, lambda model: _torch_fsdp(model, mesh_context), repeat),
    }


def _unchecked(model: MoETransformer, plan: Any, mesh_context: MeshContext) -> None:
    os.environ[agreement.SWITCH] = "1"
    try:
        apply_layouts(model, plan, mesh_context)
    finally:
        del os.environ[agreement.SWITCH]


def rows_of(ranks: Sequence[dict[str, tuple[float, list[Any]]]], layers: int, experts: int) -> list[dict[str, Any]]:
    """One row per method: its slowest rank's median; every method must place what the meshbind
    method it is compared with places."""
    rows: list[dict[str, Any]] = []
    for method in METHODS:
        reference = REFERENCE.get(method, "meshbind")
        expected = ranks[0][reference][1]
        for rank, timings in enumerate(ranks):
            if sorted(timings[method][1]) != sorted(timings[reference][1]):
                raise AssertionError(f"{method} on rank {rank} placed other parameters than {reference}")
        seconds = max(timings[method][0] for timings in ranks)
        rows.append({"layers": layers, "experts": experts, "method": method, "median_s": seconds, "parameters": len(expected)})
    seconds_of = {row["method"]: row["median_s"] for row in rows}
    for row in rows:
        row["x_meshbind"] = row["median_s"] / seconds_of[REFERENCE.get(row["method"], "meshbind")]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.world_size % 2 or args.experts % args.world_size or args.layers < 1 or args.repeat < 1:
        parser.error("--world-size must be even (tp is 2), divide --experts, and --layers and --repeat be positive")
    print(f"applying layouts to {args.layers} layers x {args.experts} experts on {args.world_size} ranks ...", file=sys.stderr)
    ranks = run_local_world(args.world_size, "apply_layouts:rank_timings", args.layers, args.experts, args.repeat, timeout=900)
    rows = rows_of(ranks, args.layers, args.experts)
    print("| layers | experts | distributed parameters | method | median s | x meshbind |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['layers']} | {row['experts']} | {row['parameters']} | {row['method']} | "
            f"{row['median_s']:.3f} | {row['x_meshbind']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
