"""The main job: a MoE transformer with CP attention and EP experts, planned, validated and bound
on a real world, checked against the same model in one process.

    meshbind demo [flags]                                  # spawns a local gloo world (4 ranks)
    torchrun --nproc-per-node 4 -m meshbind.demo [flags]   # the distributed half, under torchrun

On every rank: ``MeshContext.build`` → build on ``meta`` → ``resolve_plan`` → ``apply_layouts``
(parameters become DTensors on the meshes) → ``bind_parallel_modules`` → materialise (``to_empty`` + deterministic init) →
``validate_materialized_modules`` → forward and backward on a seeded batch → gradient reduction.
Rank 0 then runs the single-process reference and reports the largest differences.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshbind.binding import bind_parallel_modules, validate_materialized_modules
from meshbind.checkpoints import load_checkpoint, save_checkpoint, save_target_problem
from meshbind.examples.moe_transformer import (
    MoELayer,
    MoETransformer,
    TransformerConfig,
    batch,
    initialize,
    local,
    loss_head_request,
)
from meshbind.fsdp import apply_fully_shard
from meshbind.launch import run_local_world
from meshbind.layouts import apply_layouts
from meshbind.mesh import MeshContext, process_group_count
from meshbind.report import plan_report
from meshbind.resolution import resolve_plan
from meshbind.specs import FullyShard
from meshbind.world import DENSE_AXES, EXPERT_AXES, FSDP_AXES, World

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class DemoConfig:
    world_size: int = 4
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 2
    tp: int = 2
    ep: int = 2
    layers: int = 2
    experts: int = 8
    seq_len: int = 32
    batch: int = 4
    dtype: str = "float32"
    seed: int = 0
    json: bool = False
    save: str | None = None
    """A directory: after the backward, one SGD step, then the model's state saved there."""
    load: str | None = None
    """A directory saved by ``--save`` (at any layout): the model's state, in place of the seeded init."""
    allow_unverified: bool = False
    """Load ``load`` even when its manifest is gone (its files cannot be verified)."""
    lr: float = 0.1

    @property
    def transformer(self) -> TransformerConfig:
        return TransformerConfig(layers=self.layers, experts=self.experts)

    @property
    def fsdp(self) -> bool:
        """FSDP (HSDP with ``dp_replicate`` above 1) when ``dp_shard`` is above 1; otherwise the
        data-parallel ranks replicate, and the demo sums their gradients itself."""
        return self.dp_shard > 1

    @property
    def batch_shards(self) -> int:
        """The ranks the batch is split over: every data-parallel rank, replicated or sharded."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> World:
        return World(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp, ep=self.ep)


FSDP_UNITS = FullyShard(("blocks.*.moe", "blocks.*"))
"""The experts (with their router, on the expert mesh) a unit each, then each block, then the root."""


class FlagError(ValueError):
    """A demo flag that cannot work; raised before any process starts."""


LIMITS = {"layers": 64, "experts": 1024, "seq_len": 65536, "batch": 4096}
"""The demo's largest model and batch: a small model run on this machine's CPU, every rank and a
one-process reference holding it whole (beyond, it runs out of memory or time)."""
MAX_TOKENS = 2**20
"""The most tokens one demo batch may hold (``batch * seq_len``)."""


def check_flags(config: DemoConfig, cpu_count: int | None = None) -> None:
    """Every flag rule, each failure one line."""
    cores = cpu_count or os.cpu_count() or 1
    for name in ("world_size", "dp_replicate", "dp_shard", "cp", "tp", "ep", "layers", "experts", "seq_len", "batch"):
        if getattr(config, name) < 1:
            raise FlagError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(config, name)}")
    for name, limit in LIMITS.items():
        if getattr(config, name) > limit:
            raise FlagError(f"--{name.replace('_', '-')} {getattr(config, name)} is over the demo's limit of {limit}")
    if config.batch * config.seq_len > MAX_TOKENS:
        raise FlagError(
            f"--batch {config.batch} x --seq-len {config.seq_len} is {config.batch * config.seq_len:,} tokens, "
            f"over the demo's limit of {MAX_TOKENS:,}"
        )
    if not 0 <= config.seed < 2**63:
        raise FlagError(f"--seed {config.seed} must be from 0 to 2**63 - 1")
    if not math.isfinite(config.lr) or config.lr <= 0:
        raise FlagError(f"--lr {config.lr} must be a positive, finite learning rate")
    if config.world_size > 4 * cores:
        raise FlagError(
            f"a world of {config.world_size} ranks is more than this machine can sensibly run "
            f"({cores} cores: at most {4 * cores})"
        )
    try:
        world = config.world
    except ValueError as error:
        raise FlagError(str(error)) from None
    if world.size != config.world_size:
        product = " x ".join(f"--{axis.replace('_', '-')} {getattr(config, axis)}" for axis in DENSE_AXES)
        raise FlagError(f"{product} = {world.size}, not the world size {config.world_size}")
    if config.experts % config.ep:
        raise FlagError(f"--experts {config.experts} is not divisible by --ep {config.ep}")
    if config.experts < config.transformer.top_k:
        raise FlagError(
            f"--experts {config.experts} is fewer than the {config.transformer.top_k} experts each token is routed to"
        )
    if config.transformer.heads % config.tp:
        raise FlagError(f"--tp {config.tp} does not divide the {config.transformer.heads} attention heads")
    if config.seq_len % (2 * config.cp):
        raise FlagError(f"--seq-len {config.seq_len} is not divisible by 2 x --cp = {2 * config.cp} (head-tail CP chunks)")
    if config.batch % config.batch_shards:
        raise FlagError(
            f"--batch {config.batch} is not divisible by --dp-replicate x --dp-shard = {config.batch_shards} (the batch's split)"
        )
    if config.load is not None and not os.path.isfile(os.path.join(config.load, ".metadata")):
        raise FlagError(f"--load {config.load} is not a checkpoint written by --save (no .metadata in it)")
    if config.save is not None and (refused := save_target_problem(config.save)) is not None:
        raise FlagError(f"--save {refused}")


@dataclass
class Phases:
    """Seconds per phase; rank 0 also reports progress on stderr."""

    verbose: bool
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.verbose:
            print(f"[meshbind demo] {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - started


def _mesh_context(config: DemoConfig) -> MeshContext:
    world = config.world
    context = MeshContext.build(dp_replicate=world.dp_replicate, dp_shard=world.dp_shard, cp=world.cp, tp=world.tp, ep=world.ep)
    if context.fsdp_moe_mesh is None:
        # ep = 1: the experts still bind, over one-rank expert groups of a mesh made here.
        expert_mesh = init_device_mesh(context.device_type, world.expert_shape, mesh_dim_names=EXPERT_AXES)
        context = MeshContext(context.device_mesh, expert_mesh)
    return context


def run_rank(config: DemoConfig) -> dict[str, Any] | None:
    """The distributed half, on every rank of an initialised world; rank 0 returns the report."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[config.dtype]
    phases = Phases(verbose=rank == 0)
    with phases("mesh"):
        mesh_context = _mesh_context(config)
        device = (
            torch.device(mesh_context.device_type, torch.cuda.current_device())
            if mesh_context.device_type == "cuda"
            else torch.device("cpu")
        )
    with phases("build"), torch.device("meta"):
        model = MoETransformer(config.transformer).to(dtype)
    with phases("plan"):
        fully_shard = FSDP_UNITS if config.fsdp else None
        plan = resolve_plan(model, [loss_head_request()], mesh_context.layout_context(), fully_shard=fully_shard)
        # What this rank will hold, from the plan alone, before any weight exists.
        predicted_bytes = plan_report(model, plan, optimizer="none").ranks[rank].parameter_bytes
    with phases("layout"):
        groups_before = process_group_count()
        apply_layouts(model, plan, mesh_context)
    with phases("bind"):
        bound = bind_parallel_modules(model, plan, mesh_context)
    if config.fsdp:
        with phases("fully_shard"):
            apply_fully_shard(model, plan, mesh_context)
            for module in model.modules():
                if isinstance(module, FSDPModule):  # the loss is already the global mean: sum, not average
                    module.set_gradient_divide_factor(1.0)
                    # Sum alone, as gloo reduces (float32 would otherwise ask for NCCL's PREMUL_SUM).
                    module.set_force_sum_reduction_for_comms(True)
    new_groups = process_group_count() - groups_before
    with phases("materialise"):
        model.to_empty(device=device)
        if config.load is None:
            initialize(model, config.seed)
        else:
            load_checkpoint(model, config.load, allow_unverified=config.allow_unverified)
    with phases("validate"):
        validate_materialized_modules(model)
    tokens, targets = batch(config.transformer, config.batch, config.seq_len, config.seed)
    coordinates = mesh_context.world.coordinates(rank)
    dp_index = coordinates["dp_replicate"] * config.dp_shard + coordinates["dp_shard"]
    per_shard = config.batch // config.batch_shards
    rows = slice(dp_index * per_shard, (dp_index + 1) * per_shard)
    with phases("forward"):
        loss = model(tokens[rows].to(device), targets[rows].to(device))
    with phases("backward"):
        loss.backward()
    with phases("reduce"):
        gradients = _local_gradients(model, rank)
        _reduce_gradients(gradients, mesh_context, fsdp=config.fsdp)
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)
    with phases("compare"):
        local_bytes = parameter_bytes(model)
        gradients = _full_gradients(gradients)
        # Which agent (torchrun's node) runs each rank: HSDP replicates across nodes, shards within.
        nodes: list[Any] = [None] * world
        dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", "0")))
        # NCCL reduces device tensors only
        worst = torch.tensor([float(new_groups), float(predicted_bytes != local_bytes["total"])], device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    after_step = None
    if config.save is not None:
        with phases("step and save"):
            after_step = _step_save_and_evaluate(model, config, tokens[rows].to(device), targets[rows].to(device))
    with phases("reference"):
        if rank != 0:
            return None
        reference_loss, reference_gradients, full_bytes = _reference(config, dtype, tokens, targets)
        loss_diff = abs(float(total_loss) - float(reference_loss))
        grad_diff = max(_relative_difference(gradients[name].cpu(), reference) for name, reference in reference_gradients.items())
    return {
        "world_size": world,
        "axis_sizes": mesh_context.axis_sizes(),
        "dtype": config.dtype,
        "plan": plan.explain(),
        "planned_modules": len(plan.parallel_modules),
        "modules_bound": len(bound),
        "new_process_groups": int(worst[0].item()),
        "node_of_rank": nodes,
        "report_matches_every_rank": not bool(worst[1].item()),
        "report_param_bytes_per_rank": predicted_bytes,
        "loss": float(total_loss),
        "reference_loss": float(reference_loss),
        "max_abs_loss_diff": loss_diff,
        "max_rel_grad_diff": grad_diff,
        "param_bytes_per_rank": local_bytes["total"],
        "param_bytes_full": full_bytes["total"],
        "param_bytes_by_part": {part: [local_bytes[part], full_bytes[part]] for part in local_bytes if part != "total"},
        **({} if after_step is None else {"loss_after_step": after_step, "saved_to": config.save}),
        "phases": phases.seconds,
    }


def _local_gradients(model: MoETransformer, rank: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient on this rank; one that none reached is an error here, before any
    rank enters a reduction the others would wait in."""
    gradients = {name: parameter.grad for name, parameter in model.named_parameters() if parameter.grad is not None}
    missing = [name for name, _ in model.named_parameters() if name not in gradients]
    if missing:
        more = f" nor {len(missing) - 1} other parameters" if len(missing) > 1 else ""
        raise RuntimeError(f"rank {rank}: no gradient reached {missing[0]!r}{more}")
    return gradients


def _reduce_gradients(gradients: dict[str, torch.Tensor], mesh_context: MeshContext, *, fsdp: bool) -> None:
    """Sum each gradient over the ranks holding the same values of its parameter that nothing
    reduced over yet: every dim of its mesh (the expert mesh for a parameter on ``ep``, else the
    device mesh) that neither shards it nor, under FSDP, FSDP reduced over. Existing groups only."""
    for gradient in gradients.values():
        # A DTensor's local gradient is its storage: reduced in place.
        local_gradient = gradient.to_local() if isinstance(gradient, DTensor) else gradient
        for group in _replica_groups(mesh_context, gradient, fsdp):
            dist.all_reduce(local_gradient, group=group)


def _replica_groups(mesh_context: MeshContext, gradient: torch.Tensor, fsdp: bool) -> list[Any]:
    names: tuple[str, ...] = ()
    sharded: set[str] = set()
    if isinstance(gradient, DTensor):
        names = gradient.device_mesh.mesh_dim_names or ()
        sharded = {name for name, placement in zip(names, gradient.placements, strict=True) if placement.is_shard()}
    expert = mesh_context.fsdp_moe_mesh is not None and any(name in EXPERT_AXES for name in names)
    whole = mesh_context.fsdp_moe_mesh if expert else mesh_context.device_mesh
    assert whole is not None
    by_fsdp = set(FSDP_AXES["expert" if expert else "device"]) if fsdp else set()
    dims = whole.mesh_dim_names or ()
    return [
        whole.get_group(dim)
        for index, dim in enumerate(dims)
        if dim not in sharded and dim not in by_fsdp and whole.size(index) > 1
    ]


def _step_save_and_evaluate(model: MoETransformer, config: DemoConfig, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """One SGD step with the reduced gradients, the updated state saved (every rank writes its
    own shards), and the updated model's loss on the same batch, summed over the ranks."""
    with torch.no_grad():
        for parameter in model.parameters():
            assert parameter.grad is not None
            local(parameter).sub_(config.lr * local(parameter.grad))
    assert config.save is not None
    save_checkpoint(model, config.save)
    with torch.no_grad():
        loss = model(tokens, targets).detach().clone()
    dist.all_reduce(loss)
    return float(loss)


def _full_gradients(gradients: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every gradient at its full shape: a DTensor parameter's is gathered as a full tensor (for
    the comparison only: torch's advice to flatten mesh dims for speed is silenced here)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return {name: g.full_tensor() if isinstance(g, DTensor) else g for name, g in gradients.items()}
    finally:
        logger.setLevel(level)


def _reference(
    config: DemoConfig, dtype: torch.dtype, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, int]]:
    """The same model, seed and batch in this one process, without any parallelism; its loss,
    gradients and parameter bytes."""
    model = MoETransformer(config.transformer).to(dtype)
    if config.load is None:
        initialize(model, config.seed)
    else:
        load_checkpoint(model, config.load, no_dist=True, allow_unverified=config.allow_unverified)
    loss = model(tokens, targets)
    loss.backward()
    gradients = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), gradients, parameter_bytes(model)


def parameter_bytes(model: torch.nn.Module) -> dict[str, int]:
    """The bytes this rank's parameters hold: the storage of a DTensor's local shard (FSDP's padding
    included; a tied parameter once), by part of the model: the attention projections, the
    experts' fused weights, and the rest."""
    parts = dict.fromkeys(("attention", "experts", "other", "total"), 0)
    for name, parameter in model.named_parameters():
        size = local(parameter).untyped_storage().nbytes()
        part = "attention" if ".attn." in name else "experts" if name.rsplit(".", 1)[-1] in MoELayer.EXPERT_WEIGHTS else "other"
        parts[part] += size
        parts["total"] += size
    return parts


def _relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = float(expected.abs().max())
    return float((actual - expected).abs().max()) / (scale if scale > 0 else 1.0)


def _spawned_rank(config_fields: dict[str, Any]) -> dict[str, Any] | None:
    return run_rank(DemoConfig(**config_fields))


def run_local(config: DemoConfig) -> dict[str, Any]:
    """Spawn a local gloo world for ``config`` and return rank 0's report."""
    print(f"[meshbind demo] spawning {config.world_size} ranks (gloo) ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    reports = run_local_world(config.world_size, "meshbind.demo:_spawned_rank", asdict(config), timeout=300)
    report: dict[str, Any] = reports[0]
    report["seconds_total"] = time.perf_counter() - started
    return report


def print_report(report: dict[str, Any], as_json: bool) -> None:
    print(report["plan"])
    print()
    print(f"world: {report['world_size']} ranks, axes {report['axis_sizes']}, {report['dtype']}")
    print(f"modules bound: {report['modules_bound']} of {report['planned_modules']} planned")
    print(f"new process groups while applying layouts and binding: {report['new_process_groups']}")
    print("phases (rank 0): " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in report["phases"].items()))
    print(
        f"loss {report['loss']:.10g} vs reference {report['reference_loss']:.10g}: "
        f"max |loss diff| {report['max_abs_loss_diff']:.3e}"
    )
    print(f"max relative gradient difference over all parameters: {report['max_rel_grad_diff']:.3e}")
    parts = ", ".join(f"{part} {mine} of {full}" for part, (mine, full) in report["param_bytes_by_part"].items())
    print(f"parameter bytes: {report['param_bytes_per_rank']} on rank 0 of {report['param_bytes_full']} in one process ({parts})")
    matches = "equal on every rank" if report["report_matches_every_rank"] else "DIFFERENT on some rank"
    print(f"plan_report, before any weight existed: {report['report_param_bytes_per_rank']} bytes on rank 0 ({matches})")
    if "loss_after_step" in report:
        print(f"after one SGD step: loss {report['loss_after_step']:.10g}; state saved to {report['saved_to']}")
    if as_json:
        print(json.dumps({key: value for key, value in report.items() if key != "plan"}))


def add_flags(parser: argparse.ArgumentParser, *, world_size: bool) -> None:
    defaults = DemoConfig()
    if world_size:
        parser.add_argument("--world-size", type=int, default=defaults.world_size, help="ranks to spawn (gloo)")
    parser.add_argument(
        "--dp-replicate", "--dp", type=int, default=defaults.dp_replicate, help="data-parallel ranks that replicate (HSDP's)"
    )
    parser.add_argument(
        "--dp-shard", type=int, default=defaults.dp_shard, help="data-parallel ranks FSDP shards over (above 1: FSDP2)"
    )
    for name in ("cp", "tp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name), help=f"{name} axis size")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--experts", type=int, default=defaults.experts)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--batch", type=int, default=defaults.batch, help="global batch (split over dp_replicate x dp_shard)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    parser.add_argument("--save", metavar="DIR", help="after the backward, one SGD step, then save the state to DIR")
    parser.add_argument("--load", metavar="DIR", help="load the state saved by --save (at any layout) instead of the seeded init")
    parser.add_argument(
        "--allow-unverified", action="store_true", help="--load a checkpoint whose manifest is gone (unverifiable)"
    )
    parser.add_argument("--lr", type=float, default=defaults.lr, help="the learning rate of --save's step")


def config_from(args: argparse.Namespace, world_size: int) -> DemoConfig:
    fields = {name: getattr(args, name) for name in DemoConfig.__dataclass_fields__ if name != "world_size"}
    return DemoConfig(world_size=world_size, **fields)


def torchrun_main(argv: Sequence[str] | None = None) -> int:
    """``torchrun -m meshbind.demo``: the world comes from torchrun's environment; NCCL on GPUs."""
    parser = argparse.ArgumentParser(
        prog="python -m meshbind.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flags(parser, world_size=False)
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        parser.error("run me under torchrun (WORLD_SIZE is not set); `meshbind demo` spawns a local world itself")
    config = config_from(args, int(os.environ["WORLD_SIZE"]))
    try:
        check_flags(config)
    except FlagError as error:
        print(f"meshbind demo: {error}", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        report = run_rank(config)
    finally:
        dist.destroy_process_group()
    if report is not None:
        print_report(report, config.json)
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main())
