"""The meshbind command line: demo, bench, check."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshbind import FullyShard, LayoutContext, NativeParallelBindingRequest, PlanError, from_torch_plan, resolve_plan
from meshbind.checkpoints import CheckpointError, Misfit, checkpoint_fit, verified_or_refused
from meshbind.errors import index_groups
from meshbind.memory.result import StepMemory, parse_bytes
from meshbind.memory.routing import Routing
from meshbind.report import OPTIMIZERS, plan_report
from meshbind.report_page import report_page


def _demo(arguments: list[str]) -> int:
    """Spawn a local world running the MoE demo; report the plan, timings and differences.

    Imported here only: the demo model's family classes, once defined, make every resolution in
    the process walk the whole tree (``meshbind check`` and ``meshbind bench`` must not pay that)."""
    from meshbind import demo

    parser = argparse.ArgumentParser(
        prog="meshbind demo", description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    demo.add_flags(parser, world_size=True)
    args = parser.parse_args(arguments)
    try:
        config = demo.config_from(args, args.world_size)
        demo.check_flags(config)
        demo.print_report(demo.run_local(config), config.json)
    except (ValueError, TypeError) as error:
        print(f"meshbind demo: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # a rank failed: the error says which, and what it raised
        print(f"meshbind demo: {error}", file=sys.stderr)
        return 1
    return 0


def _check(args: argparse.Namespace) -> int:
    """Offline pre-flight: build the model on meta, resolve the plan, print the table or every problem."""
    context = _layout_context(args.axis)
    fully_shard = FullyShard(tuple(args.fully_shard)) if args.fully_shard is not None else None
    if args.memory:
        _check_step_sizes(args)
    if args.html is not None:
        _check_writable(args.html, "--html")
    model, requests = _model_and_plan(args)
    started = time.perf_counter()
    try:
        plan = resolve_plan(model, requests, context, progress=_ProgressBar(), fully_shard=fully_shard)
    except PlanError as error:
        if args.json:
            problems = [p.to_dict() for p in error.problems]
            print(json.dumps({"ok": False, "problems": problems, "plan": None}))
        print(str(error), file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - started
    # --json carries everything the check knows, the report included.
    report = plan_report(model, plan, optimizer=args.optimizer) if args.report or args.html or args.json else None
    misfits, verified = None, False
    if args.checkpoint is not None:
        try:  # a damaged checkpoint is a finding (exit 1), like a misfit
            verified = verified_or_refused(args.checkpoint, allow_unverified=args.allow_unverified)
            misfits = checkpoint_fit(model, args.checkpoint)
        except CheckpointError as error:
            print(str(error), file=sys.stderr)
            return 1
    memory = _step_memory(args, requests, context, fully_shard) if args.memory else None
    if args.html:
        try:
            with open(args.html, "w", encoding="utf-8") as page:
                title = f"meshbind plan report: {type(model).__name__}"
                page.write(report_page(report, title, memory))  # type: ignore[arg-type]
        except OSError as error:
            raise _UsageError(f"--html {args.html}: cannot be written ({error.strerror})") from None
    if args.json:
        result: dict[str, Any] = {"ok": not misfits, "problems": [], "plan": plan.to_dict(), "seconds": elapsed}
        if report is not None:
            result["report"] = report.to_dict()
        if memory is not None:
            result["memory"] = memory.to_dict()
            result["ok"] = result["ok"] and memory.fits is not False
        if misfits is not None:
            result["checkpoint"] = [{"kind": m.kind, "key": m.key, "reason": m.reason} for m in misfits]
            result["checkpoint_verified"] = verified
        print(json.dumps(result))
    else:
        print(report.text() if report is not None and args.report else plan.explain())
        print(f"resolved and validated in {elapsed * 1e3:.1f} ms", file=sys.stderr)
        if memory is not None:
            print()
            print(memory.text())
            print(f"traced in {memory.seconds:.1f} s", file=sys.stderr)
    if misfits:
        print(_misfit_text(misfits, args.checkpoint), file=sys.stderr)
        return 1
    if memory is not None and memory.fits is False:
        return 1
    if misfits is not None and not args.json:
        how = "every file verified against its manifest" if verified else "unverified: no meshbind manifest"
        print(f"the checkpoint in {args.checkpoint} fits the model ({how})", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    """Times the resolution of a plan over a model built on meta, phase by phase."""
    from meshbind.bench import time_resolution

    if args.model_factory is None and args.plan is None and args.hf_config is None and args.torch_plan is None:
        args.model_factory, args.plan = (
            "meshbind.examples.moe_tree:deepseek_sized_tree",
            "meshbind.examples.moe_tree:deep_plan_requests",
        )
        args.axis = args.axis or [("tp", 8)]
    context = _layout_context(args.axis)
    model, requests = _model_and_plan(args)
    print(f"timing {args.repeat} resolutions ...", file=sys.stderr)
    try:
        times = time_resolution(model, requests, context, repeat=args.repeat)
    except PlanError as error:
        print(str(error), file=sys.stderr)
        return 1
    print(json.dumps(times.to_dict()) if args.json else times.text())
    return 0


def _layout_context(axes: list[tuple[str, int]]) -> LayoutContext:
    """--axis NAME=SIZE, each name once."""
    names = [name for name, _ in axes]
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise _UsageError(f"--axis {twice} is given more than once")
    try:
        return LayoutContext(dict(axes))
    except ValueError as error:
        raise _UsageError(f"--axis: {error}") from None


def _model_and_plan(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """The model on meta and its requests: MODEL_FACTORY with PLAN or --torch-plan, or --hf-config."""
    if args.hf_config is None:
        return _factory_model_and_plan(args)
    if args.model_factory or args.plan or args.torch_plan:
        raise _UsageError("--hf-config builds the model and reads its own plans: give no MODEL_FACTORY, PLAN or --torch-plan")
    return _hf_model_and_plan(args)


def _step_memory(args: argparse.Namespace, requests: Any, context: LayoutContext, fully_shard: FullyShard | None) -> StepMemory:
    """--memory: one training step traced on each class of ranks (the model built again for it)."""
    from meshbind.errors import StepMemoryError
    from meshbind.memory.trace import step_memory

    _check_positions(args)
    print(f"tracing one training step (batch {args.batch} x seq {args.seq_len}) ...", file=sys.stderr)
    try:
        return step_memory(
            args.build,
            requests,
            context,
            batch=args.batch,
            seq_len=args.seq_len,
            fully_shard=fully_shard,
            optimizer=args.optimizer,
            activation_checkpointing=args.activation_checkpointing,
            device=args.device,
            device_memory=args.device_memory,
            routing=Routing(args.capacity_factor),
        )
    except StepMemoryError as error:
        raise _UsageError(f"--memory: {error}") from None


def _check_step_sizes(args: argparse.Namespace) -> None:
    """--memory's sizes, before any work: both given, and a batch a step can hold."""
    from meshbind.memory.trace import step_size_problem

    if args.batch is None or args.seq_len is None:
        raise _UsageError("--memory needs --batch (sequences per data-parallel rank) and --seq-len")
    if (problem := step_size_problem(args.batch, args.seq_len, ("--batch", "--seq-len"))) is not None:
        raise _UsageError(problem)


def _check_positions(args: argparse.Namespace) -> None:
    """A sequence longer than the model's positions (``max_position_embeddings``) is traced with a
    warning, or refused under --strict: the model was not made for it."""
    positions = getattr(args, "max_positions", None)
    if positions is None or args.seq_len <= positions:
        return
    message = f"--seq-len {args.seq_len} is longer than the model's max_position_embeddings {positions}"
    if args.strict:
        raise _UsageError(f"{message} (--strict)")
    print(f"warning: {message}: traced as given", file=sys.stderr)


def _misfit_text(misfits: Sequence[Misfit], directory: str) -> str:
    """Every misfit, those that differ only in a layer index on one line."""
    lines = [f"the checkpoint in {directory} does not fit the model ({len(misfits)} keys):"]
    for key, members in index_groups([(m.key, (m.kind, m.reason)) for m in misfits]):
        first = misfits[members[0]]
        count = f"{len(members)} keys " if len(members) > 1 else ""
        lines.append(f"  {first.kind:<10} {count}{key!r}: {first.reason}")
    return "\n".join(lines)


def _factory_model_and_plan(args: argparse.Namespace) -> tuple[torch.nn.Module, Sequence[NativeParallelBindingRequest]]:
    """MODEL_FACTORY built on meta, and PLAN or --torch-plan."""
    # The references may name the user's own modules in the working directory, which the
    # `meshbind` script (whose own folder heads sys.path) would not find; `python -m` would.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if args.model_factory is None:
        raise _UsageError("give a MODEL_FACTORY (module:function), or --hf-config CONFIG.json")
    if args.strict:
        raise _UsageError("--strict is for --hf-config: transformers plans only warn about keys that select nothing")
    factory = _load(args.model_factory, "MODEL_FACTORY")
    if not callable(factory):
        raise _UsageError(f"MODEL_FACTORY {args.model_factory} is not callable")
    if args.torch_plan and args.plan:
        raise _UsageError("give a PLAN or --torch-plan, not both")
    requests = _torch_plan_requests(args.torch_plan) if args.torch_plan else _plan_requests(args.plan)
    print(f"building {args.model_factory} on meta ...", file=sys.stderr)
    with torch.device("meta"):
        model = _user_code(f"MODEL_FACTORY {args.model_factory}", factory)
    args.build = lambda: _user_code(f"MODEL_FACTORY {args.model_factory}", factory)
    if not isinstance(model, torch.nn.Module):
        raise _UsageError(f"MODEL_FACTORY {args.model_factory} returned {type(model).__name__}, not an nn.Module")
    return model, requests


MAX_CONFIG_CHARS = 16 * 2**20
"""The longest --hf-config read (a config.json is kilobytes; the limit keeps /dev/zero from being read forever)."""


def _hf_model_and_plan(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """--hf-config: a transformers config file (its ``model_type`` names the class), the model built
    from it on meta (no weights, no network), and its own plans."""
    path, strict = args.hf_config, args.strict
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read(MAX_CONFIG_CHARS + 1)
        if len(text) > MAX_CONFIG_CHARS:
            raise _UsageError(
                f"--hf-config {path}: longer than {MAX_CONFIG_CHARS:,} characters; a config.json is a few kilobytes"
            )
        values = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _UsageError(f"--hf-config {path}: {error}") from None
    except RecursionError:
        raise _UsageError(f"--hf-config {path}: its JSON is nested too deep to be a config") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise _UsageError(f"--hf-config {path}: a transformers config.json is an object with a 'model_type'")
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from meshbind.interop.hf_plans import defaulted_facts, from_hf_plan

    model_type = values.pop("model_type")
    config = _user_code(f"--hf-config {path}", lambda: AutoConfig.for_model(model_type, **values))
    for name, value in defaulted_facts(config.get_text_config(), values).items():
        print(
            f"--hf-config {path}: the file sets no {name}: checked against {value}, {type(config).__name__}'s default",
            file=sys.stderr,
        )
    print(f"building {type(config).__name__} ({model_type}) on meta ...", file=sys.stderr)

    def build() -> Any:
        with torch.device("meta"):
            try:
                return AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
            except ValueError:  # not a causal LM: the base model
                return AutoModel.from_config(config)  # type: ignore[no-untyped-call]

    model = _user_code(f"--hf-config {path}: building the model", build)
    args.build = lambda: _user_code(f"--hf-config {path}: building the model", build)
    args.max_positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    return model, from_hf_plan(model, strict=strict)


def _plan_requests(reference: str | None) -> Sequence[NativeParallelBindingRequest]:
    """PLAN: a sequence of requests, or a function returning one."""
    if reference is None:
        raise _UsageError("give a PLAN (module:attribute) or --torch-plan module:attribute")
    plan_object = _load(reference, "PLAN")
    requests = _user_code(f"PLAN {reference}", plan_object) if callable(plan_object) else plan_object
    if isinstance(requests, NativeParallelBindingRequest):
        requests = (requests,)
    if (
        isinstance(requests, str)
        or not isinstance(requests, Sequence)
        or not all(isinstance(r, NativeParallelBindingRequest) for r in requests)
    ):
        raise _UsageError(f"PLAN {reference} must be, or return, a sequence of NativeParallelBindingRequest")
    return requests


def _torch_plan_requests(reference: str) -> Sequence[NativeParallelBindingRequest]:
    """--torch-plan: a parallelize_module dict (FQN key → ParallelStyle), or a function returning one."""
    plan_object = _load(reference, "--torch-plan")
    plan = _user_code(f"--torch-plan {reference}", plan_object) if callable(plan_object) else plan_object
    try:
        return from_torch_plan(plan)
    except TypeError as error:
        raise _UsageError(f"--torch-plan {reference}: {error}") from None


class _ProgressBar:
    """A bar on stderr for a step that has run two seconds or more (as tqdm users expect), redrawn
    at most twice a second; nothing for a quick one."""

    WIDTH = 30

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.drawn = 0.0

    def __call__(self, step: str, done: int, total: int) -> None:
        now = time.monotonic()
        finished = done >= total
        if now - self.started < 2.0 or (not finished and now - self.drawn < 0.5) or (finished and not self.drawn):
            return
        self.drawn = now
        filled = self.WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        end = "\n" if finished else ""
        print(f"\r{step}: [{bar}] {done:,}/{total:,} {now - self.started:.0f} s", end=end, file=sys.stderr, flush=True)


class _UsageError(Exception):
    """A bad command line: one line on stderr, exit status 2."""


def _check_writable(path: str, flag: str) -> None:
    """An output path is checked before any work: its folder must exist and be writable."""
    if not path:
        raise _UsageError(f"{flag} '': an empty path names no file")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise _UsageError(f"{flag} {path}: is a directory, not a file to write")
    if not os.path.isdir(folder):
        raise _UsageError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise _UsageError(f"{flag} {path}: the directory {folder} is not writable")


def _load(reference: str, what: str) -> Any:
    """``package.module:attribute`` → the attribute."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise _UsageError(f"{what} must be written module:attribute, got {reference!r}")
    module = _user_code(f"{what} {reference}: importing {module_name!r}", lambda: importlib.import_module(module_name))
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise _UsageError(f"{what} {reference}: module {module_name!r} has no attribute {attribute!r}") from None


def _user_code(what: str, call: Callable[[], Any]) -> Any:
    """Runs the user's code (an import, a factory, a plan function): whatever it raises is a
    one-line error naming what ran and where it failed."""
    try:
        return call()
    except SystemExit as error:  # exit() in a factory is no model: never a silent success
        raise _UsageError(f"{what} called exit({error.code!r})") from None
    except Exception as error:
        frames = traceback.extract_tb(error.__traceback__)
        where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        raise _UsageError(f"{what} raised {type(error).__name__}: {error}{where}") from error


def _axis(text: str) -> tuple[str, int]:
    name, _, size = text.partition("=")
    if not name or not size.isdigit() or int(size) < 1:
        raise argparse.ArgumentTypeError(f"an axis is NAME=SIZE with a positive size, got {text!r}")
    return name, int(size)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a positive whole number, got {text!r}")
    return int(text)


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What ``check`` and ``bench`` build the model and read the plan from, and the axes."""
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
    parser.add_argument("--axis", type=_axis, action="append", default=[], metavar="NAME=SIZE", help="a mesh axis (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshbind", description=__doc__)
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
    bench.set_defaults(run=_bench)
    check = commands.add_parser("check", help="offline pre-flight of a plan against a model built on meta")
    _add_model_arguments(check)
    check.add_argument(
        "--fully-shard",
        action="append",
        metavar="PATTERN",
        help="an FSDP2 unit per module PATTERN selects (repeatable; the root is the last unit); "
        "the report counts the padded chunks FSDP allocates",
    )
    check.add_argument("--json", action="store_true", help="one JSON object on stdout")
    check.add_argument(
        "--report", action="store_true", help="print what each rank holds (local shapes, bytes) instead of the plan table"
    )
    check.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="whose state the report counts (default: adam)")
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
    memory = check.add_argument_group("step memory (--memory)")
    memory.add_argument(
        "--memory",
        action="store_true",
        help="trace one training step (forward, backward, optimizer step) with fake tensors: each rank's peak bytes",
    )
    memory.add_argument("--batch", type=_positive, metavar="B", help="sequences per data-parallel rank")
    memory.add_argument("--seq-len", type=_positive, metavar="S", help="tokens per sequence")
    memory.add_argument(
        "--activation-checkpointing",
        choices=("none", "full"),
        default="none",
        help="full: torch's checkpoint_wrapper on each FSDP unit (or each block); default none",
    )
    memory.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the device the step runs on (default cuda)")
    memory.add_argument("--device-memory", type=_bytes, metavar="SIZE", help="the device's memory (80GiB): does the step fit?")
    memory.add_argument(
        "--capacity-factor",
        type=float,
        default=1.0,
        metavar="F",
        help="MoE routing: each rank receives F times its balanced share of tokens (default 1.0, balanced)",
    )
    check.set_defaults(run=_check)
    return parser


INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C, as a shell gives one stopped by SIGINT."""


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        return _command(arguments)
    except KeyboardInterrupt:
        command = f"meshbind {arguments[0]}" if arguments else "meshbind"
        print(f"{command}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _command(arguments: list[str]) -> int:
    if arguments[:1] == ["demo"]:
        return _demo(arguments[1:])
    parser = build_parser()
    args = parser.parse_args(arguments)
    try:
        result: int = args.run(args)
    except (_UsageError, ValueError, TypeError) as error:
        print(f"meshbind {args.command}: {error}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
