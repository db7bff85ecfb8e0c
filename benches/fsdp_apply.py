"""Applying a whole plan, TP then FSDP2, to the DeepSeek-V3 671B skeleton, against torch's own path.

    python benches/fsdp_apply.py --world-size 4 --repeat 3

Every rank of a local gloo world (``tp`` over two ranks, ``dp_shard`` over the rest) builds
torchtitan's ``deepseek_v3`` 671B on ``meta`` (``--layers`` keeps its first blocks) and times,
side by side on fresh models, the plan torchtitan writes for it (tests/torchtitan_plans.py):

- ``meshbind``: ``parallelize_checked`` of the resolved plan (torch's ``parallelize_module`` on
  exact FQNs), then ``apply_fully_shard`` (each block a unit, then the root), every check included
  (the ranks agree before each);
- ``torch``: ``parallelize_module`` with the plan's patterns, then ``fully_shard`` per block and
  the root on the same mesh, as torchtitan applies them.

Both must leave every parameter a ``DTensor`` with the same placements and local shape (the run
fails otherwise). A method's time is the median over ``--repeat`` runs on its slowest rank.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from meshbind import FullyShard, MeshContext, apply_fully_shard, from_torch_plan, parallelize_checked, resolve_plan
from meshbind.launch import run_local_world

from timing import timed_on_fresh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from torchtitan_plans import deepseek_v3_plan, torchtitan_model

METHODS = ("meshbind", "torch")
UNITS = FullyShard(("layers.*",))


def _meshbind(model: nn.Module, plan: Any, mesh_context: MeshContext) -> None:
    parallelize_checked(model, plan, mesh_context.device_mesh["tp"])
    apply_fully_shard(model, plan, mesh_context)


def _torch(model: nn.Module, mesh_context: MeshContext) -> None:
    parallelize_module(model, mesh_context.device_mesh["tp"], deepseek_v3_plan(q_lora=True))
    dense = mesh_context.device_mesh["dp_shard"]
    for block in model.layers.values():  # type: ignore[operator]
        fully_shard(block, mesh=dense)
    fully_shard(model, mesh=dense)


def _placed(model: nn.Module) -> list[tuple[str, tuple[Any, ...], tuple[int, ...]]]:
    return [
        (name, tuple(p.placements), tuple(p.to_local().shape)) for name, p in model.named_parameters() if isinstance(p, DTensor)
    ]


def rank_timings(layers: int, repeat: int) -> dict[str, tuple[float, list[Any]]]:
    world = torch.distributed.get_world_size()
    mesh_context = MeshContext.build(dp_shard=world // 2, tp=2)

    def fresh() -> nn.Module:
        return torchtitan_model("deepseek_v3", "671B", layers=layers)

    plan = resolve_plan(fresh(), from_torch_plan(deepseek_v3_plan(q_lora=True)), mesh_context.layout_context(), fully_shard=UNITS)
    methods: dict[str, Callable[[nn.Module], object]] = {
        "meshbind": lambda model: _meshbind(model, plan, mesh_context),
        "torch": lambda model: _torch(model, mesh_context),
    }
    timings = {}
    for name, method in methods.items():
        median, placed = timed_on_fresh(fresh, method, _placed, repeat, torch.distributed.barrier)
        timings[name] = (median, placed[-1])
    return timings


def rows_of(ranks: Sequence[dict[str, tuple[float, list[Any]]]], layers: int) -> list[dict[str, Any]]:
    """One row per method: its slowest rank's median; torch must place what meshbind places."""
    rows = []
    for method in METHODS:
        for rank, timings in enumerate(ranks):
            if sorted(timings[method][1]) != sorted(timings["meshbind"][1]):
                raise AssertionError(f"{method} on rank {rank} placed other parameters than meshbind")
        seconds = max(timings[method][0] for timings in ranks)
        rows.append({"layers": layers, "method": method, "median_s": seconds, "parameters": len(ranks[0][method][1])})
    for row in rows:
        row["x_meshbind"] = row["median_s"] / rows[0]["median_s"]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=61, help="the skeleton's first blocks (61: all of them)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if args.world_size < 2 or args.world_size % 2 or not 1 <= args.layers <= 61 or args.repeat < 1:
        parser.error("--world-size must be even (tp is 2), --layers from 1 to 61, --repeat positive")
    print(f"applying TP and FSDP to DeepSeek-V3 671B ({args.layers} blocks) on {args.world_size} ranks ...", file=sys.stderr)
    ranks = run_local_world(args.world_size, "fsdp_apply:rank_timings", args.layers, args.repeat, timeout=900)
    print("| skeleton | blocks | distributed parameters | method | median s | x meshbind |")
    print("|---|---|---|---|---|---|")
    for row in rows_of(ranks, args.layers):
        print(
            f"| DeepSeek-V3 671B (torchtitan) | {row['layers']} | {row['parameters']} | {row['method']} | "
            f"{row['median_s']:.3f} | {row['x_meshbind']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
