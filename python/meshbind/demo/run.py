"""The demo's run: every rank's distributed half, the one-process reference, and the report."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshbind.binding import bind_parallel_modules, validate_materialized_modules
from meshbind.checkpoints import load_checkpoint, save_checkpoint
from meshbind.demo.config import DemoConfig
from meshbind.demo.pipelined import gradients_on_first_rank, pipelined_step
from meshbind.examples.moe_layer import MoELayer
from meshbind.examples.moe_transformer import MoETransformer, batch, initialize, loss_head_request
from meshbind.examples.parallel_parts import local
from meshbind.fsdp import apply_fully_shard
from meshbind.fsdp_request import FullyShard
from meshbind.launch import run_local_world
from meshbind.layouts import apply_layouts
from meshbind.mesh import MeshContext, stage_mesh
from meshbind.names import DTYPE_NAMES, MeshSide
from meshbind.report import plan_report
from meshbind.resolution import resolve_plan
from meshbind.resolution.plan import ParallelPlan
from meshbind.world import EXPERT_AXES, FSDP_AXES

DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""The torch dtype of each of the demo's ``--dtype`` choices."""


FSDP_UNITS = FullyShard(("blocks.*.moe", "blocks.*"))
"""The experts (with their router, on the expert mesh) a unit each, then each block, then the root."""


def process_group_count() -> int:
    """How many process groups exist now (the default one included): what "creates no group" counts."""
    return len(dist.distributed_c10d._world.pg_map)


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
    context = MeshContext.build(
        pp=world.pp, dp_replicate=world.dp_replicate, dp_shard=world.dp_shard, cp=world.cp, tp=world.tp, ep=world.ep
    )
    if context.fsdp_moe_mesh is None:
        # ep = 1: the experts still bind, over one-rank expert groups of a mesh made here.
        expert_mesh = stage_mesh(context.device_type, world, world.expert_shape, EXPERT_AXES)[0]
        context = MeshContext(context.device_mesh, expert_mesh, context.pp_mesh)
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
        fully_shard = _fully_shard(config)
        plan = resolve_plan(model, [loss_head_request()], mesh_context.layout_context(), fully_shard=fully_shard, index=True)
    tokens, targets = batch(config.transformer, config.batch, config.seq_len, config.seed)
    coordinates = mesh_context.world.coordinates(rank)
    dp_index = coordinates["dp_replicate"] * config.dp_shard + coordinates["dp_shard"]
    per_shard = config.batch // config.batch_shards
    rows = slice(dp_index * per_shard, (dp_index + 1) * per_shard)
    groups_before = process_group_count()
    pipeline, step = None, None
    if config.pp > 1:
        with phases("pipeline step"):
            step = pipelined_step(config, model, plan, mesh_context, device, tokens[rows].to(device), targets[rows].to(device))
        models, loss, predicted_bytes, bound, pipeline = step.models, step.loss, step.predicted_bytes, step.bound, step.stages
    else:
        predicted_bytes, bound = _apply_plan(model, plan, mesh_context, config, device, phases)
        with phases("forward"):
            loss = model(tokens[rows].to(device), targets[rows].to(device))
        with phases("backward"):
            loss.backward()
        models = [model]
    new_groups = process_group_count() - groups_before
    with phases("reduce"):
        gradients = {name: gradient for part in models for name, gradient in _local_gradients(part, rank).items()}
        _reduce_gradients(gradients, mesh_context, fsdp=config.fsdp)
        total_loss = loss.detach().to(dtype, copy=True)  # computed in --param-dtype, summed in dtype
        dist.all_reduce(total_loss)
    with phases("compare"):
        local_bytes = _summed(parameter_bytes(part) for part in models)
        gradients = _full_gradients(gradients)
        if pipeline is not None:  # each stage's gradients to rank 0, which compares them
            gradients = gradients_on_first_rank(gradients, mesh_context)
        # Which agent (torchrun's node) runs each rank: HSDP replicates across nodes, shards within.
        nodes: list[Any] = [None] * world
        dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", "0")))
        # NCCL reduces device tensors only
        worst = torch.tensor([float(new_groups), float(predicted_bytes != local_bytes["total"])], device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    after_step = None
    if config.save is not None:
        with phases("step and save"):
            inputs = (tokens[rows].to(device), targets[rows].to(device))
            evaluate = (lambda: model(*inputs)) if step is None else (lambda: step.evaluate(*inputs))
            after_step = _step_save_and_evaluate(models, config, mesh_context, evaluate)
    with phases("reference"):
        if rank != 0:
            return None
        reference_loss, reference_gradients, full_bytes = _reference(config, dtype, tokens, targets)
        loss_diff = abs(float(total_loss) - float(reference_loss))
        grad_diff = max(_relative_difference(gradients[name].cpu(), reference) for name, reference in reference_gradients.items())
        cast_error = None
        if config.param_dtype is not None:  # how far the casts alone move the reference: the scale of grad_diff
            _, exact, _ = _reference(replace(config, param_dtype=None), dtype, tokens, targets)
            cast_error = max(_relative_difference(reference_gradients[name], gradient) for name, gradient in exact.items())
    return {
        "world_size": world,
        "axis_sizes": mesh_context.axis_sizes(),
        "dtype": config.dtype,
        "param_dtype": config.param_dtype,
        "plan": plan.explain(),
        "planned_modules": len(plan.parallel_modules),
        "modules_bound": bound,
        "pipeline": None if pipeline is None else pipeline.text(),
        "new_process_groups": int(worst[0].item()),
        "node_of_rank": nodes,
        "report_matches_every_rank": not bool(worst[1].item()),
        "report_param_bytes_per_rank": predicted_bytes,
        "loss": float(total_loss),
        "reference_loss": float(reference_loss),
        "max_abs_loss_diff": loss_diff,
        "max_rel_grad_diff": grad_diff,
        "cast_rel_grad_diff": cast_error,
        "param_bytes_per_rank": local_bytes["total"],
        "param_bytes_full": full_bytes["total"],
        "param_bytes_by_part": {part: [local_bytes[part], full_bytes[part]] for part in local_bytes if part != "total"},
        **({} if after_step is None else {"loss_after_step": after_step, "saved_to": config.save}),
        "phases": phases.seconds,
    }


def _apply_plan(
    model: MoETransformer, plan: ParallelPlan, mesh_context: MeshContext, config: DemoConfig, device: torch.device, phases: Phases
) -> tuple[int, int]:
    """Layouts, binding and FSDP on the whole model, materialised; the plan report's parameter
    bytes for this rank (from the plan alone, before any weight exists) and the modules bound."""
    rank = dist.get_rank()
    predicted_bytes = plan_report(model, plan, optimizer="none").ranks[rank].parameter_bytes
    with phases("layout"):
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
    with phases("materialise"):
        model.to_empty(device=device)
        if config.load is None:
            initialize(model, config.seed)
        else:
            load_checkpoint(model, config.load, allow_unverified=config.allow_unverified)
    with phases("validate"):
        validate_materialized_modules(model)
    return predicted_bytes, len(bound)


def _summed(parts: Iterator[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total


def _fully_shard(config: DemoConfig) -> FullyShard | None:
    """The demo's FSDP units, with the mixed precision ``--param-dtype`` asks for."""
    if not config.fsdp:
        return None
    if config.param_dtype is None:
        return FSDP_UNITS
    param_dtype = getattr(torch, DTYPE_NAMES[config.param_dtype])
    return FullyShard(FSDP_UNITS.units, param_dtype=param_dtype, reduce_dtype=torch.float32)


def _local_gradients(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
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
    by_fsdp = set(FSDP_AXES[MeshSide.EXPERT if expert else MeshSide.DEVICE]) if fsdp else set()
    dims = whole.mesh_dim_names or ()
    return [
        whole.get_group(dim)
        for index, dim in enumerate(dims)
        if dim not in sharded and dim not in by_fsdp and whole.size(index) > 1
    ]


def _step_save_and_evaluate(
    models: list[nn.Module], config: DemoConfig, mesh_context: MeshContext, evaluate: Callable[[], torch.Tensor]
) -> float:
    """One SGD step with the reduced gradients, the updated state saved (every rank writes its
    own shards), and the updated model's loss on the same batch (``evaluate()``, this rank's
    share), summed over the ranks."""
    with torch.no_grad():
        for parameter in (parameter for model in models for parameter in model.parameters()):
            assert parameter.grad is not None
            local(parameter).sub_(config.lr * local(parameter.grad))
    assert config.save is not None
    save_checkpoint(models, config.save, mesh_context=mesh_context)
    with torch.no_grad():
        loss = evaluate().detach().to(DTYPES[config.dtype], copy=True)
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
    gradients (in ``dtype``) and parameter bytes. Under ``--param-dtype`` it runs the casts FSDP2
    runs: the weights cast to it for forward and backward, the gradients back to ``dtype``."""
    model = MoETransformer(config.transformer).to(dtype)
    if config.load is None:
        initialize(model, config.seed)
    else:
        load_checkpoint(model, config.load, no_dist=True, allow_unverified=config.allow_unverified)
    held = parameter_bytes(model)
    if config.param_dtype is not None:
        model.to(getattr(torch, DTYPE_NAMES[config.param_dtype]))
    loss = model(tokens, targets)
    loss.backward()
    gradients = {name: p.grad.to(dtype) for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach().to(dtype), gradients, held


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
    reports = run_local_world(config.world_size, "meshbind.demo.run:_spawned_rank", asdict(config), timeout=300)
    report: dict[str, Any] = reports[0]
    report["seconds_total"] = time.perf_counter() - started
    return report
