"""The command line's arguments: every command's parser, read without importing torch."""

from __future__ import annotations

import argparse
import math

from meshbind.demo import config as demo_config
from meshbind.names import DTYPE_NAMES, ActivationCheckpointing, Checkpointing, Device, Optimizer
from meshbind.steptime.cluster import GPUS, Gpu, gpu_named, link_bytes_per_second
from meshbind.units import parse_bytes


class UsageError(Exception):
    """A bad command line: one line on stderr, exit status 2."""


def demo_parser() -> argparse.ArgumentParser:
    """``meshbind demo``'s flags (its own parser: ``meshbind demo --help`` lists them all)."""
    import meshbind.demo

    parser = argparse.ArgumentParser(
        prog="meshbind demo", description=meshbind.demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    demo_config.add_flags(parser, world_size=True)
    return parser


def _axis(text: str) -> tuple[str, int]:
    name, _, size = text.partition("=")
    if not name or not size.isdigit() or int(size) < 1:
        raise argparse.ArgumentTypeError(f"an axis is NAME=SIZE with a positive size, got {text!r}")
    return name, int(size)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a positive whole number, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:  # nan, 0, negatives and inf all refused here
        raise argparse.ArgumentTypeError(f"a positive number of seconds, got {text!r}")
    return seconds


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _gpu(text: str) -> Gpu:
    try:
        return gpu_named(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _link(text: str) -> float:
    try:
        return link_bytes_per_second(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _checkpointing(text: str) -> Checkpointing:
    try:
        return Checkpointing.parse(text, "the choice")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_model_arguments(parser: argparse.ArgumentParser, *, axes: bool = True) -> None:
    """What ``check``, ``bench`` and ``plan`` build the model and read the plan from, and the axes
    (``plan`` chooses its own)."""
    parser.add_argument("model_factory", metavar="MODEL_FACTORY", nargs="?", help="module:function returning the nn.Module")
    parser.add_argument(
        "plan", metavar="PLAN", nargs="?", help="module:attribute, a sequence of requests or a function returning one"
    )
    parser.add_argument(
        "--torch-plan",
        metavar="MODULE:ATTR",
        help="instead of PLAN: a torch parallelize_module dict (FQN key -> ParallelStyle), or a function returning one",
    )
    parser.add_argument(
        "--hf-config",
        metavar="CONFIG.json",
        help="instead of MODEL_FACTORY and PLAN: a transformers config file; the model is built from it on meta"
        " and its own tp/ep plans are checked",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="with --hf-config: a key that selects nothing is an error, and so is a --seq-len beyond the model's positions",
    )
    if axes:
        parser.add_argument(
            "--axis", type=_axis, action="append", default=[], metavar="NAME=SIZE", help="a mesh axis (repeatable)"
        )


def command_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshbind", description="The meshbind command line: demo, bench, check, plan.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "demo",
        help="a MoE transformer with CP attention and EP experts on a local world, checked against one process"
        " (meshbind demo --help)",
        add_help=False,
    )
    bench = commands.add_parser(
        "bench",
        help="time the resolution of a plan over a model built on meta, phase by phase",
        description="Time resolve_plan and plan_report phase by phase (walk, resolve, validate, report), the median of"
        " several runs. Without MODEL_FACTORY, PLAN or --hf-config: an embedded MoE tree of DeepSeek-V3's size.",
    )
    _add_model_arguments(bench)
    bench.add_argument("--repeat", type=_positive, default=5, metavar="N", help="timed runs (default 5); the median is shown")
    bench.add_argument("--json", action="store_true", help="one JSON object on stdout")
    check = commands.add_parser("check", help="offline pre-flight of a plan against a model built on meta")
    _add_model_arguments(check)
    check.add_argument(
        "--fully-shard",
        action="append",
        metavar="PATTERN",
        help="an FSDP2 unit per module PATTERN selects (repeatable; the root is the last unit); "
        "the report counts the padded chunks FSDP allocates",
    )
    for flag, what in (("--param-dtype", "gathered and computed in"), ("--reduce-dtype", "whose gradients are reduced in")):
        check.add_argument(
            flag,
            choices=list(DTYPE_NAMES),
            help=f"FSDP2 mixed precision: the dtype each unit is {what} (torch's MixedPrecisionPolicy; "
            "without --fully-shard, torchtitan's default units)",
        )
    check.add_argument("--json", action="store_true", help="one JSON object on stdout")
    check.add_argument(
        "--report", action="store_true", help="print what each rank holds (local shapes, bytes) instead of the plan table"
    )
    check.add_argument(
        "--optimizer",
        choices=Optimizer.choices(),
        default=Optimizer.ADAM.value,
        help="whose state the report counts (default: adam)",
    )
    check.add_argument("--html", metavar="PATH", help="write the report as one self-contained page")
    check.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="check a torch.distributed.checkpoint or safetensors directory against the model (metadata only)",
    )
    check.add_argument(
        "--allow-unverified",
        action="store_true",
        help="with --checkpoint: check a meshbind checkpoint whose manifest is gone (its files cannot be verified)",
    )
    pipeline = check.add_argument_group("pipeline (--axis pp=N, N above 1)")
    pipeline.add_argument(
        "--pp-schedule",
        default="1F1B",
        metavar="NAME",
        help="torch's schedule: GPipe, 1F1B (default), Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, "
        "DualPipeV",
    )
    pipeline.add_argument("--pp-microbatches", type=_positive, metavar="M", help="microbatches per step (default: one per stage)")
    memory = check.add_argument_group("one training step traced (--memory, --comms, --step-time)")
    memory.add_argument(
        "--memory",
        action="store_true",
        help="trace one training step (forward, backward, optimizer step) with fake tensors: each rank's peak bytes",
    )
    memory.add_argument(
        "--comms",
        action="store_true",
        help="trace one training step with fake tensors: every collective of each rank, by kind, axes, dtype, calls and bytes",
    )
    memory.add_argument(
        "--step-time",
        action="store_true",
        help="with --comms: the step's time on --gpu per rank class (compute, exposed collectives, bubble), tokens/s, MFU",
    )
    memory.add_argument("--batch", type=_positive, metavar="B", help="sequences per data-parallel rank")
    memory.add_argument("--seq-len", type=_positive, metavar="S", help="tokens per sequence")
    memory.add_argument(
        "--activation-checkpointing",
        type=_checkpointing,
        default=Checkpointing(ActivationCheckpointing.NONE),
        metavar="{none,full,selective-layer:K,selective-op}",
        help="full: torch's checkpoint_wrapper on each FSDP unit (or each block); selective-layer:K: on every K-th; "
        "selective-op: on each, saving torchtitan's list of operators; default none",
    )
    memory.add_argument("--device-memory", type=_bytes, metavar="SIZE", help="the device's memory (80GiB): does the step fit?")
    _add_cluster_arguments(memory, required=False)
    _add_step_arguments(memory)
    _add_plan_command(commands)
    return parser


def _add_cluster_arguments(group: argparse._ArgumentGroup, *, required: bool) -> None:
    """The GPUs a step is priced on and how they are joined."""
    what = "the GPU each layout is priced on" if required else "the GPU --step-time prices the step on"
    group.add_argument("--gpu", type=_gpu, required=required, metavar="{" + ",".join(GPUS) + "}", help=what)
    group.add_argument("--gpus-per-node", type=_positive, default=8, metavar="N", help="GPUs per node over NVLink (default 8)")
    group.add_argument(
        "--inter-node", type=_link, default="400Gbps", metavar="BANDWIDTH", help="each GPU's link between nodes (default 400Gbps)"
    )


def _add_step_arguments(group: argparse._ArgumentGroup) -> None:
    """The traced step's device and routing, alike for ``check`` and ``plan``."""
    group.add_argument(
        "--device", choices=Device.choices(), default=Device.CUDA.value, help="the device the step runs on (default cuda)"
    )
    group.add_argument(
        "--capacity-factor",
        type=float,
        default=1.0,
        metavar="F",
        help="MoE routing: each rank receives F times its balanced share of tokens (default 1.0, balanced)",
    )


def _add_plan_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    plan = commands.add_parser(
        "plan",
        help="every layout of a cluster that is valid and fits, ranked by tokens/s per GPU",
        description="Enumerate every layout of --gpus GPUs (pp, dp_replicate, dp_shard, cp, tp, ep, the pipeline schedule and "
        "microbatches, activation checkpointing, mixed precision), refuse each invalid one with the rule check applies, trace "
        "and price each valid one whose state fits, and rank those that fit by tokens/s per GPU.",
    )
    _add_model_arguments(plan, axes=False)
    cluster = plan.add_argument_group("the cluster")
    cluster.add_argument("--gpus", type=_positive, required=True, metavar="N", help="the GPUs of the job")
    _add_cluster_arguments(cluster, required=True)
    cluster.add_argument("--device-memory", type=_bytes, required=True, metavar="SIZE", help="each GPU's memory (80GiB)")
    work = plan.add_argument_group("the work")
    work.add_argument("--global-batch", type=_positive, required=True, metavar="B", help="sequences per step, over all ranks")
    work.add_argument("--seq-len", type=_positive, required=True, metavar="S", help="tokens per sequence")
    work.add_argument(
        "--optimizer", choices=Optimizer.choices(), default=Optimizer.ADAM.value, help="whose state is counted (default: adam)"
    )
    _add_step_arguments(work)
    tried = plan.add_argument_group("what is tried (each repeatable; default: every choice)")
    tried.add_argument("--pp-schedule", action="append", metavar="NAME", help="a torch schedule (default: all seven)")
    tried.add_argument(
        "--pp-microbatches", type=_positive, action="append", metavar="M", help="default: one per stage and one per sequence"
    )
    tried.add_argument(
        "--activation-checkpointing",
        type=_checkpointing,
        action="append",
        metavar="MODE",
        help="none, full, selective-layer:K, selective-op (default: none, selective-op, full)",
    )
    tried.add_argument(
        "--param-dtype", choices=["bf16", "fp32"], action="append", help="FSDP2's compute dtype, reduced in fp32 (default: bf16)"
    )
    tried.add_argument("--top", type=_positive, default=10, metavar="K", help="the layouts listed (default 10)")
    plan.add_argument(
        "--time-limit",
        type=_seconds,
        metavar="SECONDS",
        help="stop tracing once the search has run this long and list the best found so far (default: trace every layout)",
    )
    plan.add_argument("--json", action="store_true", help="one JSON object on stdout: every candidate")
    plan.add_argument(
        "--html", metavar="PATH", help="write one self-contained page: peak memory against speed, the best layouts, what fell out"
    )
