"""Ranks agree before the first collective.

Every entry point that leads to collectives (``apply_layouts``, ``bind_parallel_modules``,
``apply_hf_plan``, ``parallelize_checked``, ``save_checkpoint``, ``load_checkpoint``) first calls ``check_ranks_agree``:
each rank digests what it is about to do — its model's parameters (FQN, shape, dtype), the resolved
plan (FQN, protocol, placements) and its meshes' layout — and the ranks compare digests in two
all-reduce of eight integers (the maximum of the digest's four words and of their negations:
the maximum and the minimum agree exactly when every rank's digest is the same), on the default
group, creating none. Only when they differ do the ranks
exchange more, to name who differs and where. A rank that never arrives is named within
``MESHBIND_RANK_CHECK_TIMEOUT`` seconds (gloo's monitored barrier); ``MESHBIND_NO_RANK_CHECK=1``
turns the check off.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
import weakref
from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshbind.errors import RankMismatchError
from meshbind.mesh import MeshContext
from meshbind.model_index import ModelIndex, index_of
from meshbind.placements import placements_text
from meshbind.resolution.fsdp import policy_fields
from meshbind.resolution.plan import ParallelPlan

SWITCH = "MESHBIND_NO_RANK_CHECK"
TIMEOUT = "MESHBIND_RANK_CHECK_TIMEOUT"
_DEFAULT_TIMEOUT = 300.0
_SHOWN = 3
"""How many disagreeing ranks a message describes (the others are counted)."""


Entry = tuple[str, str]
"""What a rank is about to do, one thing at a time: ``("parameter layers.0.weight", "(16, 16) float32")``."""


def model_entries(model: nn.Module, known: ModelIndex | None = None) -> list[Entry]:
    """Each parameter once, as ``named_parameters()`` gives it: FQN, global shape, dtype, device
    type and whether it is frozen (a frozen weight has no gradient to reduce). Read from
    ``known`` when it is the model's own index (as resolved), else from a walk."""
    index = index_of(model, known)
    described = [
        f"{kind.shape} {kind.dtype_name} on {kind.device}" + ("" if kind.requires_grad else ", frozen") for kind in index.kinds
    ]
    return [(f"parameter {fqn}", described[kind]) for fqn, kind in zip(index.parameter_fqns, index.parameter_kinds, strict=True)]


def plan_entries(plan: ParallelPlan) -> list[Entry]:
    """The plan's axes, each planned module (protocol and version, its parameters' placements), and
    FSDP's options and each of its units."""
    entries = [("plan axes", str(dict(plan.context.axis_sizes)))]
    for fqn, spec in plan.parallel_modules.items():
        placed = ", ".join(f"{path}={placements_text(named)}" for path, named in plan.sharding[fqn].params.items())
        entries.append((f"plan {fqn or '<root>'}", f"{spec.protocol} v{spec.version} {placed}"))
    if plan.fsdp is not None:
        entries.append(("fsdp reshard_after_forward", str(plan.fsdp.reshard_after_forward)))
        policy = plan.fsdp.policy
        entries.append(("fsdp mixed precision", str(None if policy is None else policy_fields(policy))))
        entries += [
            (f"fsdp unit {unit.fqn or '<root>'}", f"{unit.mesh} {None if unit.policy is None else policy_fields(unit.policy)}")
            for unit in plan.fsdp.units
        ]
    return entries


def mesh_entries(*meshes: DeviceMesh | None) -> list[Entry]:
    """Each mesh's dim names and shape (not its rank list: that is the world's size)."""
    return [
        (f"mesh {index}", f"{mesh.mesh_dim_names} {tuple(mesh.shape)}") for index, mesh in enumerate(meshes) if mesh is not None
    ]


def plan_agreement(model: nn.Module, plan: ParallelPlan, mesh_context: MeshContext) -> list[Entry]:
    """What ranks applying or binding ``plan`` over ``mesh_context`` must agree on."""
    return [
        *model_entries(model, plan.index),
        *plan_entries(plan),
        *mesh_entries(mesh_context.device_mesh, mesh_context.fsdp_moe_mesh),
    ]


def check_ranks_agree(
    what: str,
    entries: Callable[[], Sequence[Entry]],
    *,
    model: nn.Module | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Raise ``RankMismatchError`` on every rank unless every rank's ``entries()`` are the same;
    nothing else happens first, so nothing has changed when it raises. A no-op outside a world of
    several ranks, under torch's fake group (a trace: one process stands for every rank), and
    under ``MESHBIND_NO_RANK_CHECK=1``.

    With ``model``, an agreement is remembered: a later call on that model whose entries this rank
    digests exactly as the ranks last agreed (the plan's steps in turn: layouts, binding, FSDP)
    needs no collective, since every rank then holds what all of them agreed on. A rank whose
    entries changed since compares again; if only some ranks changed, those wait for the others
    and are told within ``MESHBIND_RANK_CHECK_TIMEOUT`` which ranks did not come.

    ``group`` (default: every rank) is the ranks that must agree: under a pipeline, one stage's
    ranks for what only that stage holds (``MeshContext.stage_group``)."""
    if os.environ.get(SWITCH) == "1" or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_backend() == "fake" or dist.get_world_size(group) == 1:
        return
    check_timeout()
    mine = list(entries())
    digest = hashlib.sha256("\n".join(f"{key}\t{value}" for key, value in mine).encode("utf-8", "surrogatepass")).digest()
    if model is not None and _AGREED.get(model) == digest:
        return
    _compare(what, mine, digest, group)
    if model is not None:
        _AGREED[model] = digest


_AGREED: weakref.WeakKeyDictionary[nn.Module, bytes] = weakref.WeakKeyDictionary()
"""Each model's digest the ranks last agreed on."""


def _compare(what: str, mine: list[Entry], digest: bytes, group: dist.ProcessGroup | None) -> None:
    _everyone_arrives(what, group)
    words = torch.frombuffer(bytearray(digest), dtype=torch.int64).clone()
    # One all-reduce: the maximum of the words and of their negations (minus the minimum); both
    # equal every rank's words exactly when every rank holds the same digest.
    extremes = torch.cat([words, -words])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if torch.equal(extremes[:4], -extremes[4:]):
        return
    raise RankMismatchError(what, _differences(mine, words, group))


def check_timeout() -> float:
    """``MESHBIND_RANK_CHECK_TIMEOUT`` in seconds (300 when unset); anything but a positive,
    finite number is a ``ValueError`` naming the variable, before any collective."""
    raw = os.environ.get(TIMEOUT)
    if raw is None:
        return _DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{TIMEOUT}={raw!r} must be a positive number of seconds")
    return seconds


def _everyone_arrives(what: str, group: dist.ProcessGroup | None) -> None:
    """Gloo's monitored barrier names the ranks that do not arrive in time (other backends wait
    for their process group's own timeout)."""
    if dist.get_backend(group) != "gloo":
        return
    seconds = check_timeout()
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as error:
        raise RankMismatchError(what, [f"not every rank arrived within {seconds:g} s ({error})"]) from None


def _differences(mine: list[Entry], digest: torch.Tensor, group: dist.ProcessGroup | None) -> list[str]:
    """Which ranks differ from the ranks most agree with, and their first differing entry (ranks
    of the world, whatever the group)."""
    size = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    rank = dist.get_rank()
    digests = [torch.empty_like(digest) for _ in range(size)]
    dist.all_gather(digests, digest, group=group)
    keys = [tuple(d.tolist()) for d in digests]
    common = Counter(keys).most_common(1)[0][0]
    reference = ranks[keys.index(common)]
    others = [ranks[index] for index, key in enumerate(keys) if key != common]
    shared: list[object] = [mine if rank == reference else None]
    dist.broadcast_object_list(shared, src=reference, group=group)
    theirs = shared[0]
    assert isinstance(theirs, list)
    found = _first_difference(mine, theirs, reference) if rank in others[:_SHOWN] else None
    gathered: list[object] = [None] * size
    dist.all_gather_object(gathered, found, group=group)
    described = dict(zip(ranks, gathered, strict=True))
    lines = [f"rank {r} differs from rank {reference} first at {described[r]}" for r in others[:_SHOWN]]
    if len(others) > _SHOWN:
        lines.append(f"and {len(others) - _SHOWN} more ranks differ from rank {reference}")
    return lines


def _first_difference(mine: Sequence[Entry], theirs: Sequence[Entry], reference: int) -> str:
    ours, its = dict(mine), dict(theirs)
    for key in [*ours, *(key for key in its if key not in ours)]:
        if ours.get(key) != its.get(key):
            return f"{key}: {ours.get(key, 'absent')} here, {its.get(key, 'absent')} on rank {reference}"
    return "the order of its entries"
