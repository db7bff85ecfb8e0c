"""One real training step per rank on a gloo world, measured by the CPU allocator's record
(``measured_step_peak``): the truth ``test_step_memory.py`` holds the traced estimate to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining.schedules import _PipelineSchedule

from meshbind import FullyShard, LayoutContext, MeshContext, StepMemory, resolve_plan, step_memory
from meshbind.examples.moe_layer import MoELayer
from meshbind.examples.moe_transformer import (
    MoETransformer,
    TransformerConfig,
    batch,
    initialize,
    loss_head_request,
)
from meshbind.examples.parallel_parts import local
from meshbind.memory.step import apply_plan, make_optimizer, make_optimizer_state, pipelined_training_step
from meshbind.mesh import stage_mesh
from meshbind.names import Checkpointing
from meshbind.pipeline import Pipeline, pipeline_parts, pipeline_schedule, runnable_stage, stage_loss
from meshbind.world import DENSE_AXES, EXPERT_AXES

from step_memory_truth import count_every_thread, lowest_step_added, measured_peak, measured_step_peak

DEMO_UNITS = FullyShard(("blocks.*.moe", "blocks.*"))


def demo_units(dp_shard: int, param_dtype: str | None) -> FullyShard | None:
    """The demo's FSDP units when ``dp_shard`` shards, in mixed precision with ``param_dtype``."""
    if dp_shard == 1:
        return None
    return FullyShard(DEMO_UNITS.units, param_dtype=param_dtype, reduce_dtype="float32" if param_dtype else None)


def traced(
    build: Callable[[], nn.Module],
    requests: Any,
    context: LayoutContext,
    *,
    fully_shard: FullyShard | None = None,
    **settings: Any,
) -> StepMemory:
    """``step_memory`` under the plan resolved, with its index, on a model ``build()`` makes on meta
    (as ``meshbind check --memory`` runs it); a transformers plan is read from that model."""
    with torch.device("meta"):
        model = build()
    if type(requests).__name__ == "HFPlan":
        from meshbind.interop.hf_plans import from_hf_plan

        requests = from_hf_plan(model, strict=requests.strict)
    return step_memory(build, resolve_plan(model, requests, context, fully_shard=fully_shard, index=True), **settings)


def balanced_route(layer: MoELayer) -> Any:
    """The router's own weights, but each token's experts chosen round robin over every (token,
    choice) pair: every expert-parallel rank receives the same number of pairs, the routing the
    estimate assumes."""

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probabilities = torch.softmax(nn.functional.linear(x, local(layer.router.weight)), dim=-1)
        pairs = torch.arange(x.size(0) * layer.top_k, device=x.device).view(x.size(0), layer.top_k)
        expert_ids = pairs % probabilities.size(-1)
        weights = probabilities.gather(1, expert_ids)
        return expert_ids, weights / weights.sum(dim=-1, keepdim=True)

    return route


def demo_step_peaks(
    axes: dict[str, int],
    layers: int,
    experts: int,
    batch_per_rank: int,
    seq_len: int,
    checkpointing: list[str],
    optimizer_name: str = "adam",
    dtype: str = "float32",
    param_dtype: str | None = None,
) -> list[int]:
    """This rank's measured peak of one demo training step (the optimizer's state made by a first
    step) under each of ``checkpointing`` in turn, on one world; with ``param_dtype``, FSDP2 mixed
    precision (gradients reduced in float32)."""
    count_every_thread()  # before anything the step may free exists
    peaks = []
    for mode in checkpointing:
        model, optimizer, inputs = planned_demo(
            axes, layers, experts, batch_per_rank, seq_len, mode, optimizer_name, dtype, param_dtype
        )
        peaks.append(measured_step_peak(model, optimizer, inputs, {}))
    return peaks


def planned_demo(
    axes: dict[str, int],
    layers: int,
    experts: int,
    batch_per_rank: int,
    seq_len: int,
    checkpointing: str,
    optimizer_name: str = "adam",
    dtype: str = "float32",
    param_dtype: str | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's demo model under its plan, routed as the estimate assumes, its optimizer (its
    state made) and this data-parallel rank's batch."""
    context = LayoutContext(axes)
    world = context.world
    mesh_context = MeshContext(
        init_device_mesh("cpu", world.dense_shape, mesh_dim_names=DENSE_AXES),
        init_device_mesh("cpu", world.expert_shape, mesh_dim_names=EXPERT_AXES),
    )
    config = TransformerConfig(layers=layers, experts=experts)
    with torch.device("meta"):
        model = MoETransformer(config).to(getattr(torch, dtype))
    plan = resolve_plan(model, [loss_head_request()], context, fully_shard=demo_units(world.dp_shard, param_dtype))
    apply_plan(model, plan, mesh_context, Checkpointing.parse(checkpointing, "checkpointing"))
    model.to_empty(device="cpu")
    initialize(model, seed=0)
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.route = balanced_route(module)  # type: ignore[method-assign]
    optimizer = make_optimizer(model, optimizer_name, "cpu")
    make_optimizer_state(optimizer)
    dp_rank = mesh_context.world.coordinates(torch.distributed.get_rank())["dp_shard"]
    tokens, targets = batch(config, batch_per_rank * world.dp_shard, seq_len, seed=0)
    rows = slice(dp_rank * batch_per_rank, (dp_rank + 1) * batch_per_rank)
    return model, optimizer, (tokens[rows], targets[rows])


def pipelined_demo_step_peaks(
    axes: dict[str, int], layers: int, batch_per_rank: int, seq_len: int, runs: list[tuple[str, int, str]]
) -> list[int]:
    """This rank's measured peak of one pipelined demo step for each ``(schedule, microbatches,
    checkpointing)`` of ``runs``, in turn on one world (``planned_pipelined_demo``)."""
    count_every_thread()
    world = PipelinedDemoWorld(axes, layers, batch_per_rank, seq_len)
    peaks = []
    for schedule_name, microbatches, checkpointing in runs:
        step, models, optimizer, inputs = world.planned(schedule_name, microbatches, checkpointing)
        peaks.append(measured_peak(step, models, optimizer, inputs))
    return peaks


class PipelinedDemoWorld:
    """This rank's meshes of a pipelined demo world, and its data-parallel rank's batch."""

    def __init__(self, axes: dict[str, int], layers: int, batch_per_rank: int, seq_len: int) -> None:
        self.context = LayoutContext(axes)
        world = self.context.world
        mesh_context = MeshContext.build(**world.axis_sizes())
        if mesh_context.fsdp_moe_mesh is None:  # ep = 1: the experts bind over one-rank expert groups
            expert_mesh = stage_mesh("cpu", world, world.expert_shape, EXPERT_AXES)[0]
            mesh_context = MeshContext(mesh_context.device_mesh, expert_mesh, mesh_context.pp_mesh)
        self.mesh_context = mesh_context
        self.config = TransformerConfig(layers=layers)
        dp_rank = mesh_context.world.coordinates(torch.distributed.get_rank())["dp_shard"]
        tokens, targets = batch(self.config, batch_per_rank * world.dp_shard, seq_len, seed=0)
        rows = slice(dp_rank * batch_per_rank, (dp_rank + 1) * batch_per_rank)
        self.tokens, self.targets = tokens[rows].contiguous(), targets[rows].contiguous()

    def planned(
        self, schedule_name: str, microbatches: int, checkpointing: str
    ) -> tuple[Callable[[], None], nn.Module, torch.optim.Optimizer | None, tuple[Any, Any]]:
        """This rank's stages cut, planned (FSDP over ``dp_shard``), materialised and routed as the
        estimate assumes, the optimizer's state made; one step of torch's schedule
        (``first_step_again``), the stages, the optimizer and the step's inputs."""
        world, mesh_context = self.context.world, self.mesh_context
        with torch.device("meta"):
            whole = MoETransformer(self.config)
        plan = resolve_plan(whole, [loss_head_request()], self.context, fully_shard=demo_units(world.dp_shard, None), index=True)
        stages, parts = pipeline_parts(whole, plan, Pipeline(schedule_name, microbatches), mesh_context)
        for part in parts:
            apply_plan(part.model, part.plan, mesh_context, Checkpointing.parse(checkpointing, "checkpointing"))
            part.model.to_empty(device="cpu")
            assert isinstance(part.model, MoETransformer)
            initialize(part.model, seed=0)
            for module in part.model.modules():
                if isinstance(module, MoELayer):
                    module.route = balanced_route(module)  # type: ignore[method-assign]
        models = nn.ModuleList(part.model for part in parts)
        optimizer = make_optimizer(models, "adam", "cpu")
        make_optimizer_state(optimizer)
        last_stage = len(stages.stages) - 1
        last = next((part.model for part in parts if part.stage == last_stage), None)

        def loss(hidden: torch.Tensor, microbatch_targets: torch.Tensor, last: Any = last, count: int = microbatches) -> Any:
            return last.pipeline_loss(hidden, microbatch_targets) / count

        schedule = pipeline_schedule(stages, parts, mesh_context, torch.device("cpu"), loss)
        given = self.tokens if any(part.stage == 0 for part in parts) else None
        wanted = self.targets if last is not None else None
        return first_step_again(schedule, optimizer, given, wanted), models, optimizer, (given, wanted)


def hf_step_peaks(
    name: str, axes: dict[str, int], fully_shard: FullyShard | None, batch_per_rank: int, seq_len: int, checkpointing: list[str]
) -> list[int]:
    """This rank's measured peak of one step of a small transformers model under its own plans,
    under each of ``checkpointing`` in turn, on one world."""
    count_every_thread()
    peaks = []
    for mode in checkpointing:
        model, optimizer, kwargs = planned_hf(name, axes, fully_shard, batch_per_rank, seq_len, mode)
        peaks.append(measured_step_peak(model, optimizer, (), kwargs))
    return peaks


def planned_hf(
    name: str, axes: dict[str, int], fully_shard: FullyShard | None, batch_per_rank: int, seq_len: int, checkpointing: str
) -> tuple[nn.Module, torch.optim.Optimizer | None, dict[str, Any]]:
    """This rank's small transformers model under its own plans, routed as the estimate assumes,
    its optimizer (its state made) and one forward call's keyword arguments."""
    from meshbind.interop.hf_plans import from_hf_plan

    context = LayoutContext(axes)
    world = context.world
    mesh_context = MeshContext(
        init_device_mesh("cpu", world.dense_shape, mesh_dim_names=DENSE_AXES),
        init_device_mesh("cpu", world.expert_shape, mesh_dim_names=EXPERT_AXES),
    )
    with torch.device("meta"):
        model = hf_transformer(name)
    plan = resolve_plan(model, from_hf_plan(model), context, fully_shard=fully_shard)
    apply_plan(model, plan, mesh_context, Checkpointing.parse(checkpointing, "checkpointing"))
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            held = local(parameter)
            held.copy_(0.02 * torch.randn(held.shape, generator=generator))
    model.train()
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.forward = balanced_hf_route(module)  # type: ignore[method-assign]
    optimizer = make_optimizer(model, "adam", "cpu")
    make_optimizer_state(optimizer)
    ids = torch.randint(0, model.config.vocab_size, (batch_per_rank, seq_len), generator=generator)
    return model, optimizer, {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def first_step_again(
    schedule: _PipelineSchedule,
    optimizer: torch.optim.Optimizer | None,
    tokens: torch.Tensor | None,
    targets: torch.Tensor | None,
) -> Callable[[], None]:
    """One pipelined step that leaves nothing of its own behind: torch keeps the last stage's
    outputs of a step until the next one starts (and frees them there, before its peak), which
    would lower a next step's total by bytes it never held at its peak."""

    def step() -> None:
        pipelined_training_step(schedule, optimizer, tokens, targets)
        for stage in getattr(schedule, "_stages", None) or [schedule._stage]:  # type: ignore[attr-defined]
            stage.clear_runtime_states()

    return step


def hf_pipelined_step_peak(
    name: str, axes: dict[str, int], fully_shard: FullyShard | None, batch_per_rank: int, seq_len: int
) -> int:
    """This rank's measured peak of one 1F1B step (four microbatches) of a small transformers model
    (four layers) split over ``pp``, under its own plans, each stage made runnable by ``hf_stage``."""
    count_every_thread()
    from meshbind.interop.hf_plans import from_hf_plan

    context = LayoutContext(axes)
    mesh_context = MeshContext.build(**context.world.axis_sizes())
    with torch.device("meta"):
        whole = hf_transformer(name, layers=4)
    plan = resolve_plan(whole, from_hf_plan(whole), context, fully_shard=fully_shard, index=True)
    stages, parts = pipeline_parts(whole, plan, Pipeline("1F1B", microbatches=4), mesh_context)
    generator = torch.Generator().manual_seed(0)
    for part in parts:
        runnable_stage(part.model, part.stage, len(stages.stages))
        apply_plan(part.model, part.plan, mesh_context, Checkpointing.parse("none", "checkpointing"))
        part.model.to_empty(device="cpu")
        with torch.no_grad():
            for parameter in part.model.parameters():
                held = local(parameter)
                held.copy_(0.02 * torch.randn(held.shape, generator=generator))
        part.model.train()
    models = nn.ModuleList(part.model for part in parts)
    optimizer = make_optimizer(models, "adam", "cpu")
    make_optimizer_state(optimizer)
    last = next((part.model for part in parts if part.stage == len(stages.stages) - 1), None)
    loss = stage_loss(last) if last is not None else None

    def scaled(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        assert loss is not None
        return loss(logits, labels) / 4

    schedule = pipeline_schedule(stages, parts, mesh_context, torch.device("cpu"), scaled)
    ids = torch.randint(0, whole.config.vocab_size, (batch_per_rank, seq_len), generator=generator)
    given = ids if any(part.stage == 0 for part in parts) else None
    wanted = ids.clone() if last is not None else None
    return measured_peak(first_step_again(schedule, optimizer, given, wanted), models, optimizer, (given, wanted))


def hf_pipelined_estimate(axes: dict[str, int], fully_shard: FullyShard | None) -> dict[int, int]:
    """``step_memory``'s peak per rank for ``hf_pipelined_step_peak``'s step (batch 8 x seq 64)."""
    from meshbind.interop.hf_plans import from_hf_plan

    with torch.device("meta"):
        model = hf_transformer("llama", layers=4)
    plan = resolve_plan(model, from_hf_plan(model), LayoutContext(axes), fully_shard=fully_shard, index=True)
    estimate = step_memory(
        lambda: hf_transformer("llama", layers=4), plan, batch=8, seq_len=64, device="cpu", pipeline=Pipeline("1F1B", 4)
    )
    return {c.first_rank + offset: c.peak_bytes for c in estimate.classes for offset in range(c.ranks)}


def hf_transformer(name: str, layers: int = 2) -> nn.Module:
    """A small transformers model; its experts, if any, run transformers' ``grouped_mm``, whose
    token counts stay on the device (the default loops over the experts a batch hit, which a fake
    tensor cannot say)."""
    from hf_models import hf_model

    model = hf_model(name, layers=layers)
    if getattr(model.config, "num_experts", None):
        model.config._experts_implementation = "grouped_mm"
    return model


def balanced_hf_route(router: nn.Module) -> Any:
    """A transformers top-k router's own logits and weights, with each token's experts chosen round
    robin over the (token, choice) pairs, so every expert-parallel rank receives an equal share."""

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = nn.functional.linear(hidden_states, router.weight)
        probabilities = torch.softmax(logits, dtype=torch.float, dim=-1)
        pairs = torch.arange(hidden_states.size(0) * router.top_k, device=logits.device).view(-1, router.top_k)
        indices = pairs % router.num_experts
        weights = probabilities.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), indices

    return forward


def deep_demo() -> MoETransformer:
    """The demo's model with eight blocks: more alike ones than step memory's deepest trace."""
    return MoETransformer(TransformerConfig(layers=8, experts=EXPERTS_OF_DEEP_DEMO))


EXPERTS_OF_DEEP_DEMO = 8


def uneven_first_steps(growing_rank: int) -> int:
    """How many steps ``lowest_step_added`` ran on this rank of a world whose every step sums a
    tensor across the ranks, where only ``growing_rank``'s first two steps add different amounts."""
    count_every_thread()
    sizes = iter([2**18, 2**19, 2**19] if dist.get_rank() == growing_rank else [2**18] * 3)
    steps = []

    def step() -> None:
        held = torch.ones(next(sizes))
        dist.all_reduce(held[:1])
        steps.append(held.numel())
        del held

    lowest_step_added(step)
    return len(steps)
