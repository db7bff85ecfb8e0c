"""What each command does, once its arguments are read."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from meshbind.checkpoints import CheckpointError, Misfit, checkpoint_fit, verified_or_refused
from meshbind.cli.arguments import UsageError
from meshbind.cli.models import model_and_plan
from meshbind.cli.pages import check_writable, write_page
from meshbind.cli.progress import ProgressBar
from meshbind.comms.result import StepComms
from meshbind.errors import PipelineError, PlanError, index_groups
from meshbind.fsdp_request import FullyShard
from meshbind.memory.result import StepMemory
from meshbind.pipeline import Pipeline, schedule_named, split_stages
from meshbind.report import plan_report
from meshbind.report_page import report_page
from meshbind.resolution import ParallelPlan, resolve_plan
from meshbind.routing import Routing
from meshbind.specs import LayoutContext
from meshbind.steptime.cluster import GPUS, Cluster
from meshbind.steptime.estimate import step_time

T = TypeVar("T")


def demo(args: argparse.Namespace) -> int:
    """Spawn a local world running the MoE demo; report the plan, timings and differences.

    Imported here only: the demo model's family classes, once defined, make every resolution in
    the process walk the whole tree (``meshbind check`` and ``meshbind bench`` must not pay that)."""
    from meshbind.demo.checks import check_flags
    from meshbind.demo.config import config_from
    from meshbind.demo.output import print_report
    from meshbind.demo.run import run_local

    try:
        config = config_from(args, args.world_size)
        check_flags(config)
        print_report(run_local(config), config.json)
    except (ValueError, TypeError) as error:
        print(f"meshbind demo: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # a rank failed: the error says which, and what it raised
        print(f"meshbind demo: {error}", file=sys.stderr)
        return 1
    return 0


def check(args: argparse.Namespace) -> int:
    """Offline pre-flight: build the model on meta, resolve the plan, print the table or every problem."""
    context = _layout_context(args.axis)
    fully_shard = _fully_shard(args)
    pipeline = _pipeline(args, context.world.pp)
    if args.step_time and not args.comms:
        raise UsageError("--step-time prices the step --comms traces: give --comms too")
    if args.step_time and args.gpu is None:
        raise UsageError("--step-time needs --gpu (one of " + ", ".join(GPUS) + ")")
    if args.memory or args.comms:
        _check_step_sizes(args)
    if args.html is not None:
        check_writable(args.html, "--html")
    model, requests = model_and_plan(args)
    if args.memory or args.comms:
        _check_positions(args)
    started = time.perf_counter()
    try:
        with ProgressBar() as bar:
            # One walk of the model: the report and step memory read its index.
            plan = resolve_plan(model, requests, context, progress=bar, fully_shard=fully_shard, index=True)
    except PlanError as error:
        if args.json:
            problems = [p.to_dict() for p in error.problems]
            print(json.dumps({"ok": False, "problems": problems, "plan": None}))
        print(str(error), file=sys.stderr)
        return 1
    stages = None
    if pipeline is not None:
        assert plan.index is not None
        try:
            stages = split_stages(plan.index, context.world.pp, pipeline)
        except PipelineError as error:
            print(str(error), file=sys.stderr)
            return 1
    elapsed = time.perf_counter() - started
    # --json carries everything the check knows, the report included.
    wanted = args.report or args.html or args.json
    report = plan_report(model, plan, optimizer=args.optimizer, pipeline=stages) if wanted else None
    misfits, verified = None, False
    if args.checkpoint is not None:
        try:  # a damaged checkpoint is a finding (exit 1), like a misfit
            verified = verified_or_refused(args.checkpoint, allow_unverified=args.allow_unverified)
            misfits = checkpoint_fit(model, args.checkpoint)
            if stages is not None:
                holder = stages.holders()
                misfits = [_with_stage(misfit, holder) for misfit in misfits]
        except CheckpointError as error:
            print(str(error), file=sys.stderr)
            return 1
    memory, comms = _traced_steps(args, plan, pipeline)
    cluster = Cluster(args.gpu, args.gpus_per_node, args.inter_node) if args.step_time else None
    timed = step_time(comms, cluster) if comms is not None and cluster is not None else None
    if args.html:
        title = f"meshbind plan report: {type(model).__name__}"
        write_page(args.html, report_page(report, title, memory, timed))  # type: ignore[arg-type]
    if args.json:
        result: dict[str, Any] = {"ok": not misfits, "problems": [], "plan": plan.to_dict(), "seconds": elapsed}
        if report is not None:
            result["report"] = report.to_dict()
        if stages is not None:
            result["pipeline"] = stages.to_dict()
        if memory is not None:
            result["memory"] = memory.to_dict()
            result["ok"] = result["ok"] and memory.fits is not False
        if comms is not None:
            result["comms"] = comms.to_dict()
        if timed is not None:
            result["step_time"] = timed.to_dict()
        if misfits is not None:
            result["checkpoint"] = [{"kind": m.kind, "key": m.key, "reason": m.reason} for m in misfits]
            result["checkpoint_verified"] = verified
        print(json.dumps(result))
    else:
        print("\n".join([report.text(), *plan.warning_lines()]) if report is not None and args.report else plan.explain())
        if stages is not None:
            print(stages.text())
        print(f"resolved and validated in {elapsed * 1e3:.1f} ms", file=sys.stderr)
        if memory is not None:
            print()
            print(memory.text())
            print(f"traced in {memory.seconds:.1f} s", file=sys.stderr)
        if comms is not None:
            print()
            print(comms.text())
            print(f"collectives traced in {comms.seconds:.1f} s", file=sys.stderr)
        if timed is not None:
            print()
            print(timed.text())
    if misfits:
        print(_misfit_text(misfits, args.checkpoint), file=sys.stderr)
        return 1
    if memory is not None and memory.fits is False:
        return 1
    if misfits is not None and not args.json:
        how = "every file verified against its manifest" if verified else "unverified: no meshbind manifest"
        print(f"the checkpoint in {args.checkpoint} fits the model ({how})", file=sys.stderr)
    return 0


def _pipeline(args: argparse.Namespace, pp: int) -> Pipeline | None:
    """The pipeline ``--pp-schedule`` and ``--pp-microbatches`` ask for, under ``pp`` above 1."""
    if pp == 1:
        return None
    try:
        schedule = schedule_named(args.pp_schedule, "--pp-schedule").name
    except ValueError as error:
        raise UsageError(str(error)) from None
    return Pipeline(schedule, microbatches=args.pp_microbatches)


def bench(args: argparse.Namespace) -> int:
    """Times the resolution of a plan over a model built on meta, phase by phase."""
    from meshbind.bench import time_resolution

    if args.model_factory is None and args.plan is None and args.hf_config is None and args.torch_plan is None:
        args.model_factory, args.plan = (
            "meshbind.examples.moe_tree:deepseek_sized_tree",
            "meshbind.examples.moe_tree:deep_plan_requests",
        )
        args.axis = args.axis or [("tp", 8)]
    context = _layout_context(args.axis)
    model, requests = model_and_plan(args)
    print(f"timing {args.repeat} resolutions ...", file=sys.stderr)
    try:
        times = time_resolution(model, requests, context, repeat=args.repeat)
    except PlanError as error:
        print(str(error), file=sys.stderr)
        return 1
    print(json.dumps(times.to_dict()) if args.json else times.text())
    return 0


def _fully_shard(args: argparse.Namespace) -> FullyShard | None:
    """--fully-shard's units and the mixed-precision flags; with a dtype but no unit, the default units."""
    units = tuple(args.fully_shard) if args.fully_shard is not None else None
    if units is None and args.param_dtype is None and args.reduce_dtype is None:
        return None
    return FullyShard(units, param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype)


def _layout_context(axes: list[tuple[str, int]]) -> LayoutContext:
    """--axis NAME=SIZE, each name once."""
    names = [name for name, _ in axes]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise UsageError(f"--axis {twice} is given more than once")
    try:
        return LayoutContext(dict(axes))
    except ValueError as error:
        raise UsageError(f"--axis: {error}") from None


def _traced_steps(
    args: argparse.Namespace, plan: ParallelPlan, pipeline: Pipeline | None
) -> tuple[StepMemory | None, StepComms | None]:
    """--memory and --comms: one training step traced on each class of ranks under the plan
    resolved (the model built again for it), under the pipeline's schedule with ``pp`` above 1;
    with both, each step is traced once for both answers."""
    from meshbind.comms.trace import step_comms
    from meshbind.comms.with_memory import step_memory_and_comms
    from meshbind.memory.trace import step_memory

    if args.memory and args.comms:
        print(f"tracing one training step and its collectives (batch {args.batch} x seq {args.seq_len}) ...", file=sys.stderr)
        return _traced("--memory", step_memory_and_comms, args, plan, pipeline, device_memory=args.device_memory)
    if args.memory:
        print(f"tracing one training step (batch {args.batch} x seq {args.seq_len}) ...", file=sys.stderr)
        return _traced("--memory", step_memory, args, plan, pipeline, device_memory=args.device_memory), None
    if args.comms:
        print(f"tracing the collectives of one training step (batch {args.batch} x seq {args.seq_len}) ...", file=sys.stderr)
        return None, _traced("--comms", step_comms, args, plan, pipeline)
    return None, None


def _traced(
    flag: str, trace: Callable[..., T], args: argparse.Namespace, plan: ParallelPlan, pipeline: Pipeline | None, **more: Any
) -> T:
    """``trace`` (``step_memory``, ``step_comms`` or both) of the step the command line asks for;
    a refused setting is a usage error of ``flag``."""
    from meshbind.errors import StepMemoryError

    try:
        return trace(
            args.build,
            plan,
            batch=args.batch,
            seq_len=args.seq_len,
            optimizer=args.optimizer,
            activation_checkpointing=args.activation_checkpointing,
            device=args.device,
            routing=Routing(args.capacity_factor),
            pipeline=pipeline,
            **more,
        )
    except (StepMemoryError, ValueError) as error:
        raise UsageError(f"{flag}: {error}") from None


def _check_step_sizes(args: argparse.Namespace) -> None:
    """--memory's and --comms' sizes, before any work: both given, and a batch a step can hold."""
    from meshbind.memory.trace import step_size_problem

    if args.batch is None or args.seq_len is None:
        flag = "--memory" if args.memory else "--comms"
        raise UsageError(f"{flag} needs --batch (sequences per data-parallel rank) and --seq-len")
    if (problem := step_size_problem(args.batch, args.seq_len, ("--batch", "--seq-len"))) is not None:
        raise UsageError(problem)


def _check_positions(args: argparse.Namespace) -> None:
    """A sequence longer than the model's positions (``max_position_embeddings``) is traced with a
    warning, or refused under --strict: the model was not made for it."""
    positions = getattr(args, "max_positions", None)
    if positions is None or args.seq_len <= positions:
        return
    message = f"--seq-len {args.seq_len} is longer than the model's max_position_embeddings {positions}"
    if args.strict:
        raise UsageError(f"{message} (--strict)")
    print(f"warning: {message}: traced as given", file=sys.stderr)


def _with_stage(misfit: Misfit, holder: Callable[[str], str]) -> Misfit:
    """A key of the model the checkpoint lacks or holds at another shape, naming the pipeline stage
    that loads it (``PipelineStages.holders``)."""
    if misfit.kind == "unexpected":
        return misfit
    return replace(misfit, reason=f"{misfit.reason} ({holder(misfit.key)} holds it)")


def _misfit_text(misfits: Sequence[Misfit], directory: str) -> str:
    """Every misfit, those that differ only in a layer index on one line."""
    lines = [f"the checkpoint in {directory} does not fit the model ({len(misfits)} keys):"]
    for key, members in index_groups([(m.key, (m.kind, m.reason)) for m in misfits]):
        first = misfits[members[0]]
        count = f"{len(members)} keys " if len(members) > 1 else ""
        lines.append(f"  {first.kind:<10} {count}{key!r}: {first.reason}")
    return "\n".join(lines)
