"""Ranks that are about to do different things (run on every rank by test_rank_agreement.py):
each scenario makes the last rank differ, then calls an entry point that leads to collectives."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from meshbind import (
    FullyShard,
    LayoutContext,
    MeshContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    RankMismatchError,
    apply_layouts,
    resolve_plan,
)

SPEC = ParallelModuleSpec("plain")


def blocks(count: int, meta: bool, wide: int | None = None) -> nn.Module:
    """``count`` Linear(16, 16) blocks; ``wide``: that block is Linear(16, 32)."""
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = nn.Module()
        model.layers = nn.ModuleList(nn.Linear(16, 32 if index == wide else 16) for index in range(count))
    return model


def request(pattern: str, shard_two_by: int = 0) -> NativeParallelBindingRequest:
    def layout(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        dim = shard_two_by if fqn == "layers.2" else 0
        return ModuleShardingSpec(params={"weight": {"tp": Shard(dim)}})

    return NativeParallelBindingRequest((pattern,), SPEC, layout)


Scenario = tuple[nn.Module, NativeParallelBindingRequest, "FullyShard | None"]


def frozen(model: nn.Module, fqn: str) -> nn.Module:
    model.get_parameter(fqn).requires_grad_(False)
    return model


def scenarios(last: bool) -> dict[str, Callable[[bool], Scenario]]:
    """Each scenario's model, request and FSDP units on this rank (``last``: the rank that differs)."""
    units = FullyShard(("layers.*",), reshard_after_forward=not last)
    return {
        "one more layer": lambda meta: (blocks(5 if last else 4, meta), request("layers.*"), None),
        "another pattern": lambda meta: (blocks(4, meta), request("layers.<0-2>" if last else "layers.*"), None),
        "another placement": lambda meta: (blocks(4, meta), request("layers.*", shard_two_by=1 if last else 0), None),
        "another shape": lambda meta: (blocks(4, meta, wide=1 if last else None), request("layers.*"), None),
        "a frozen weight": lambda meta: (
            frozen(blocks(4, meta), "layers.1.weight") if last else blocks(4, meta),
            request("layers.*"),
            None,
        ),
        "another device": lambda meta: (blocks(4, meta != last), request("layers.*"), None),
        "another reshard_after_forward": lambda meta: (blocks(4, meta), request("layers.*"), units),
        "the same": lambda meta: (blocks(4, meta), request("layers.*"), None),
    }


def run_scenarios(meta: bool, only: str | None = None) -> dict[str, str | None]:
    """Each scenario's error text on this rank (``None``: it applied), and whether anything changed."""
    world = dist.get_world_size()
    context = MeshContext.build(dp=world // 2, tp=2)
    last = dist.get_rank() == world - 1
    found: dict[str, str | None] = {}
    for name, build in scenarios(last).items():
        if only is not None and name != only:
            continue
        model, planned, units = build(meta)
        before = {fqn: (type(p), p.clone()) for fqn, p in model.named_parameters()}
        plan = resolve_plan(model, [planned], context.layout_context(), fully_shard=units)
        try:
            apply_layouts(model, plan, context)
            found[name] = None
        except RankMismatchError as error:
            changed = [fqn for fqn, p in model.named_parameters() if type(p) is not before[fqn][0] or isinstance(p, DTensor)]
            if not meta:
                changed += [fqn for fqn, p in model.named_parameters() if not p.is_meta and not torch.equal(p, before[fqn][1])]
            found[name] = str(error) + (f"\nCHANGED {changed}" if changed else "")
    return found


def one_rank_late(seconds: float, written: str) -> None:
    """The last rank arrives ``seconds`` late; the others give up first, naming it, and rank 0
    writes what it raised to ``written`` (the timed-out group is closed: the world ends failed)."""
    os.environ["MESHBIND_RANK_CHECK_TIMEOUT"] = "2"
    context = MeshContext.build(dp=dist.get_world_size() // 2, tp=2)
    model, planned = blocks(4, True), request("layers.*")
    plan = resolve_plan(model, [planned], context.layout_context())
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(seconds)
        return
    started = time.monotonic()
    try:
        apply_layouts(model, plan, context)
        outcome = "applied"
    except RankMismatchError as error:
        outcome = f"{time.monotonic() - started:.1f} s: {error}"
    if dist.get_rank() == 0:
        with open(written, "w", encoding="utf-8") as file:
            file.write(outcome)


def switched_off() -> str | None:
    """With MESHBIND_NO_RANK_CHECK=1 the check is skipped: another placement on meta then applies."""
    os.environ["MESHBIND_NO_RANK_CHECK"] = "1"
    try:
        return run_scenarios(True, only="another placement")["another placement"]
    finally:
        del os.environ["MESHBIND_NO_RANK_CHECK"]


def other_entry_points() -> dict[str, str | None]:
    """The last rank differs at each other entry point that leads to collectives; the error text
    each raised on this rank (``None``: it went through)."""
    import tempfile

    from torch.distributed.tensor.parallel import ColwiseParallel

    from meshbind import apply_hf_plan, from_hf_plan, from_torch_plan, parallelize_checked
    from meshbind.checkpoints import load_checkpoint, save_checkpoint

    from hf_models import hf_model

    world = dist.get_world_size()
    last = dist.get_rank() == world - 1
    context = MeshContext.build(dp=world // 2, tp=2)
    found: dict[str, str | None] = {}

    def attempt(name: str, call: Callable[[], object]) -> None:
        try:
            call()
            found[name] = None
        except RankMismatchError as error:
            found[name] = str(error)

    torch_model = blocks(5 if last else 4, meta=True)
    torch_plan = resolve_plan(torch_model, from_torch_plan({"layers.*": ColwiseParallel()}), context.layout_context())
    attempt("parallelize_checked", lambda: parallelize_checked(torch_model, torch_plan, context.device_mesh["tp"]))
    hf = hf_model("llama", layers=3 if last else 2)
    hf_plan = resolve_plan(hf, from_hf_plan(hf), context.layout_context())
    attempt("apply_hf_plan", lambda: apply_hf_plan(hf, hf_plan, tp_mesh=context.device_mesh["tp"]))
    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory, src=0)
    attempt("save_checkpoint", lambda: save_checkpoint(blocks(5 if last else 4, meta=False), f"{directory[0]}/other"))
    save_checkpoint(blocks(4, meta=False), f"{directory[0]}/checkpoint")
    attempt("load_checkpoint", lambda: load_checkpoint(blocks(5 if last else 4, meta=False), f"{directory[0]}/checkpoint"))
    return found


def remembered_agreement() -> dict[str, int]:
    """How many times the ranks met to compare: layouts, binding and FSDP of one plan agree once;
    a new plan on every rank is compared again."""
    from meshbind import FullyShard, agreement, apply_fully_shard, bind_parallel_modules

    meetings = {"count": 0}
    compare = agreement._compare

    def counted(*args: object) -> None:
        meetings["count"] += 1
        compare(*args)  # type: ignore[arg-type]

    agreement._compare = counted  # type: ignore[assignment]
    try:
        context = MeshContext.build(dp_shard=dist.get_world_size() // 2, tp=2)
        model = blocks(4, meta=True)
        plan = resolve_plan(model, [request("layers.*")], context.layout_context(), fully_shard=FullyShard(("layers.*",)))
        apply_layouts(model, plan, context)
        bind_parallel_modules(model, plan, context)
        apply_fully_shard(model, plan, context)
        once = meetings["count"]
        other = resolve_plan(model, [request("layers.<0-1>")], context.layout_context())
        bind_parallel_modules(model, other, context)  # everyone's plan changed: they compare again
        return {"after layouts, binding and fsdp": once, "after another plan": meetings["count"]}
    finally:
        agreement._compare = compare  # type: ignore[assignment]


def one_rank_changes_between_steps() -> None:
    """After the ranks agree on the layouts, the last rank adds a parameter before binding: it
    compares again while the others, unchanged, bind without a collective and go on. The last
    rank is told within the timeout which rank did not come."""
    from meshbind import agreement, bind_parallel_modules

    os.environ[agreement.TIMEOUT] = "2"
    world, rank = dist.get_world_size(), dist.get_rank()
    context = MeshContext.build(dp_shard=world // 2, tp=2)
    model = blocks(4, meta=True)
    plan = resolve_plan(model, [request("layers.*")], context.layout_context())
    apply_layouts(model, plan, context)
    if rank == world - 1:
        model.extra = nn.Linear(2, 2, device="meta")
    bind_parallel_modules(model, plan, context)
    time.sleep(4)  # the others enter no collective while the last rank waits for them


def timeout_refused(value: str) -> str | None:
    """What ``apply_layouts`` raises on this rank with ``MESHBIND_RANK_CHECK_TIMEOUT=value``."""
    os.environ["MESHBIND_RANK_CHECK_TIMEOUT"] = value
    context = MeshContext.build(tp=dist.get_world_size())
    model = blocks(2, True)
    plan = resolve_plan(model, [request("layers.*")], context.layout_context())
    try:
        apply_layouts(model, plan, context)
    except ValueError as error:
        return str(error)
    return None


def refused_on(ranks: list[int]) -> None:
    """The given ranks refuse, as a damaged checkpoint makes every rank refuse."""
    from meshbind.checkpoints import CheckpointError

    if dist.get_rank() in ranks:
        raise CheckpointError(["'ckpt/__0_0.distcp': 16 bytes differ"], "the checkpoint is damaged", "problem")
