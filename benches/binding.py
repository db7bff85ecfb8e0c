"""Binding against the field: what binding a resolved plan costs, beside binding by hand and
through torch's ``parallelize_module``.

    python benches/binding.py --layers 2,61,1024 --world-size 2 --json bench-results/binding.json

Every rank of a local gloo world (``cp`` and ``ep`` over all its ranks) builds the demo's
``MoETransformer`` on ``meta`` with L decoder blocks (a CP attention and an EP MoE layer each,
family members, and the loss head by request: 2L + 1 bound modules), resolves the plan once, and
times each method on a fresh model, side by side:

- ``meshbind``: ``bind_parallel_modules`` — every owner checked and every context prepared before
  the first ``bind_parallel``, the plan recorded, family layouts applied, all or nothing;
- ``meshbind_rebind``: the same call on a model that plan already bound (every module skipped);
- ``by_hand``: the loop a user writes today for this model: contexts built once, each module's
  ``bind_parallel`` called, no check, no record, nothing restored when one fails;
- ``torch_parallelize_module``: torch's ``parallelize_module`` with one ``ParallelStyle`` per FQN
  whose ``_apply`` calls ``bind_parallel`` with the same contexts.

A method's time is the median over ``--repeat`` runs on its slowest rank; after every run each
bound module must hold its binding, and no method may create a process group (the run fails
otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from meshbind.binding import ParallelBinding, bind_parallel_modules
from meshbind.cp import CPContext
from meshbind.demo.run import process_group_count
from meshbind.ep import EPContext
from meshbind.examples.moe_transformer import DecoderBlock, MoETransformer, TransformerConfig, loss_head_request
from meshbind.launch import run_local_world
from meshbind.mesh import MeshBinding, MeshContext
from meshbind.resolution import ParallelPlan, resolve_plan

from timing import timed_on_fresh

METHODS = ("meshbind", "meshbind_rebind", "by_hand", "torch_parallelize_module")


def _bindings(mesh_context: MeshContext, num_experts: int) -> dict[str, ParallelBinding]:
    """What each binding kind receives, its contexts built from the prebuilt axis meshes."""
    meshes = MeshBinding(mesh_context)
    return {
        "cp": ParallelBinding(meshes, cp_context=CPContext(meshes.axis_mesh("cp"))),
        "ep": ParallelBinding(meshes, ep_context=EPContext(meshes.axis_mesh("ep"), num_experts)),
        "mesh": ParallelBinding(meshes),
    }


def _by_hand(model: MoETransformer, mesh_context: MeshContext) -> None:
    bindings = _bindings(mesh_context, model.config.experts)
    for block in cast(list[DecoderBlock], model.blocks):
        block.attn.bind_parallel(bindings["cp"])
        block.moe.bind_parallel(bindings["ep"])
    model.head.bind_parallel(bindings["mesh"])


def _bound_count(model: MoETransformer) -> int:
    """How many modules hold a binding now (what each one's ``bind_parallel`` keeps)."""
    blocks = cast(list[DecoderBlock], model.blocks)
    held = [block.attn.cp for block in blocks] + [block.moe.ep for block in blocks] + [model.head.binding]
    return sum(context is not None for context in held)


class _BindingStyle(ParallelStyle):
    """A ParallelStyle that hands the module its binding, as a style applies a layout."""

    def __init__(self, binding: ParallelBinding) -> None:
        super().__init__()
        self.binding = binding

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.bind_parallel(self.binding)  # type: ignore[operator]
        return module


def _torch_parallelize_module(model: MoETransformer, plan: ParallelPlan, mesh_context: MeshContext) -> None:
    bindings = _bindings(mesh_context, model.config.experts)
    styles = {fqn: _BindingStyle(bindings[spec.binding_kind]) for fqn, spec in plan.parallel_modules.items()}
    parallelize_module(model, mesh_context.device_mesh["cp"], styles)  # type: ignore[arg-type]


def _timed(
    setup: Callable[[], MoETransformer], method: Callable[[MoETransformer], object], repeat: int
) -> tuple[float, int, int]:
    """The median time of ``method`` on models from ``setup``, the fewest modules bound after a
    run, and the process groups it created."""
    groups_before = process_group_count()
    median, bound = timed_on_fresh(setup, method, _bound_count, repeat)
    return median, min(bound), process_group_count() - groups_before


def rank_timings(layers: int, repeat: int) -> dict[str, tuple[float, int, int]]:
    """On one rank of the world: each method's (median seconds, fewest modules bound, groups created)."""
    world = torch.distributed.get_world_size()
    mesh_context = MeshContext.build(dp=1, cp=world, tp=1, ep=world)
    config = TransformerConfig(layers=layers, experts=2 * world)

    def fresh() -> MoETransformer:
        with torch.device("meta"):
            return MoETransformer(config)

    plan = resolve_plan(fresh(), [loss_head_request()], mesh_context.layout_context())

    def bound() -> MoETransformer:
        model = fresh()
        bind_parallel_modules(model, plan, mesh_context)
        return model

    def rebind(model: MoETransformer) -> None:
        if bind_parallel_modules(model, plan, mesh_context):
            raise AssertionError("binding a model again with the plan that bound it bound something")

    return {
        "meshbind": _timed(fresh, lambda model: bind_parallel_modules(model, plan, mesh_context), repeat),
        "meshbind_rebind": _timed(bound, rebind, repeat),
        "by_hand": _timed(fresh, lambda model: _by_hand(model, mesh_context), repeat),
        "torch_parallelize_module": _timed(fresh, lambda model: _torch_parallelize_module(model, plan, mesh_context), repeat),
    }


def run(layer_counts: Sequence[int], world_size: int, repeat: int) -> list[dict[str, Any]]:
    """One row per (layers, method): the slowest rank's median; fails when methods bind different
    numbers of modules or any creates a process group."""
    rows = []
    for layers in layer_counts:
        print(f"binding {layers} layers on {world_size} ranks ...", file=sys.stderr, flush=True)
        rows += rows_of(layers, run_local_world(world_size, "binding:rank_timings", layers, repeat))
    return rows


def rows_of(layers: int, ranks: Sequence[dict[str, tuple[float, int, int]]]) -> list[dict[str, Any]]:
    """The rows of one model size from every rank's timings."""
    rows = []
    for method in METHODS:
        median = max(timings[method][0] for timings in ranks)
        bound = {timings[method][1] for timings in ranks}
        groups = max(timings[method][2] for timings in ranks)
        if bound != {2 * layers + 1} or groups:
            raise AssertionError(f"{method} at {layers} layers bound {sorted(bound)} modules and created {groups} process groups")
        rows.append({"layers": layers, "bound": 2 * layers + 1, "method": method, "median_s": median, "new_groups": groups})
    return rows


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    header = ("layers", "bound modules", "method", "median ms", "us per module", "x meshbind", "new groups")
    reference = {row["layers"]: row["median_s"] for row in rows if row["method"] == "meshbind"}
    lines = [
        (
            str(row["layers"]),
            str(row["bound"]),
            row["method"],
            f"{row['median_s'] * 1e3:.3f}",
            f"{row['median_s'] / row['bound'] * 1e6:.1f}",
            f"{row['median_s'] / reference[row['layers']]:.2f}",
            str(row["new_groups"]),
        )
        for row in rows
    ]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(line) + " |" for line in lines]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="2,61,1024", help="comma-separated decoder block counts")
    parser.add_argument("--world-size", type=int, default=2, help="ranks of the local gloo world, at least 2 (cp = ep = world)")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    try:
        layer_counts = [int(part) for part in args.layers.split(",")]
    except ValueError:
        parser.error(f"--layers must be comma-separated ints, got {args.layers!r}")
    if min(layer_counts) < 1 or args.repeat < 1:
        parser.error("--layers and --repeat must be positive")
    if args.world_size < 2:
        parser.error("--world-size must be at least 2: the MoE layers need an expert mesh")
    rows = run(layer_counts, args.world_size, args.repeat)
    print("\n".join(table(rows)))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
