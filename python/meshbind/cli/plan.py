"""``meshbind plan``: every layout of a cluster, the best first, each with the ``meshbind check``
command that gives the same figures for it."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace

from meshbind.cli.models import model_and_plan
from meshbind.cli.pages import check_writable, write_page
from meshbind.cli.progress import ProgressBar
from meshbind.routing import Routing
from meshbind.search import Choices, LayoutSearch, plan_layouts
from meshbind.search.result import CANNOT_BE_TRACED
from meshbind.search.space import PRECISION_CHOICES, REDUCE_DTYPE, Layout
from meshbind.search_page import search_page
from meshbind.steptime.cluster import GIGA, Cluster
from meshbind.units import size_text


def plan(args: argparse.Namespace) -> int:
    """Exit 0 with a ranked table (after ``--time-limit``, of the layouts traced by then); 1 when no
    layout fits (saying what would) or none was traced in time; 130 after Ctrl-C, with the best
    found so far."""
    # Every precision keeps float32 shards, so a transformers model is built in float32 (as check
    # builds it under --param-dtype).
    args.param_dtype = args.param_dtype or list(PRECISION_CHOICES)
    if args.html is not None:
        check_writable(args.html, "--html")
    model, requests = model_and_plan(args)
    choices = Choices(args.pp_schedule, args.pp_microbatches, args.activation_checkpointing, args.param_dtype)
    cluster = Cluster(args.gpu, args.gpus_per_node, args.inter_node)
    with ProgressBar() as bar:
        search = plan_layouts(
            model,
            requests,
            build=args.build,
            gpus=args.gpus,
            cluster=cluster,
            device_memory=args.device_memory,
            global_batch=args.global_batch,
            seq_len=args.seq_len,
            optimizer=args.optimizer,
            choices=choices,
            device=args.device,
            routing=Routing(args.capacity_factor),
            progress=bar,
            time_limit=args.time_limit,
        )
    commands = tuple(_check_command(args, c.layout, args.global_batch) for c in search.ranked if c.layout is not None)
    search = replace(search, commands=commands)
    if args.html is not None:
        write_page(args.html, search_page(search, f"meshbind plan: {type(model).__name__}", args.top))
    if args.json:
        print(json.dumps(search.to_dict()))
    else:
        print(search.text(args.top))
        print(f"searched in {search.seconds:.1f} s", file=sys.stderr)
    if search.interrupted:
        return 130  # as a shell gives a command stopped by SIGINT (meshbind.cli.INTERRUPTED)
    if not search.ranked:
        print(_nothing_fits(search), file=sys.stderr)
        return 1
    return 0


def _nothing_fits(search: LayoutSearch) -> str:
    """Why nothing is ranked, and the nearest thing that would work."""
    if search.out_of_time:
        left = f" ({search.untraced():,} layouts whose state fits left untraced)" if search.untraced() else ""
        return (
            f"meshbind plan: the {search.time_limit:g} s time limit ended the search before it found a layout that "
            f"fits{left}: give it more time (--time-limit)"
        )
    least = search.least_memory()
    if least is not None and least.memory is not None and least.layout is not None:
        return (
            f"meshbind plan: no layout fits {size_text(search.device_memory)}: the least any needs is "
            f"{size_text(least.memory.peak_bytes)} ({least.layout.text()})"
        )
    untraced = next((c for c in search.candidates if c.rule == CANNOT_BE_TRACED), None)
    if untraced is not None and untraced.layout is not None:
        return f"meshbind plan: no valid layout could be traced; {untraced.layout.text()}: {untraced.detail}"
    nowhere = f"meshbind plan: no layout of this model can run on {search.gpus:,} GPUs (see the rules above)"
    if search.nearest is None or search.nearest.layout is None:
        return f"{nowhere}, nor on any count up to {2 * search.gpus:,} whose state fits {size_text(search.device_memory)}"
    nearest = search.nearest.layout
    return f"{nowhere}: the nearest count that can is {nearest.world.size:,} GPUs, e.g. {nearest.text()}"


def _check_command(args: argparse.Namespace, layout: Layout, global_batch: int) -> str:
    """The ``meshbind check`` that traces and prices ``layout`` as the search did."""
    world = layout.world
    words = ["meshbind", "check"]
    if args.hf_config is not None:
        words += ["--hf-config", args.hf_config]
    else:
        words += [args.model_factory, *([args.plan] if args.plan else ["--torch-plan", args.torch_plan])]
    words += ["--strict"] * bool(args.strict)
    for axis, size in layout.axes().items():
        words += ["--axis", f"{axis}={size}"]
    words += ["--param-dtype", layout.param_dtype, "--reduce-dtype", REDUCE_DTYPE]
    if layout.schedule is not None:
        words += ["--pp-schedule", layout.schedule, "--pp-microbatches", str(layout.microbatches)]
    words += ["--batch", str(global_batch // (world.dp_replicate * world.dp_shard)), "--seq-len", str(args.seq_len)]
    words += ["--activation-checkpointing", str(layout.checkpointing), "--optimizer", args.optimizer]
    words += ["--memory", "--comms", "--step-time", "--gpu", args.gpu.name, "--gpus-per-node", str(args.gpus_per_node)]
    words += ["--inter-node", f"{args.inter_node / GIGA:g}GB/s", "--device-memory", str(args.device_memory)]
    words += ["--device", args.device, "--capacity-factor", str(args.capacity_factor)]
    return shlex.join(words)
