"""Checks that run on every rank of a real gloo world (started by tests/world.py).

``run_checks`` runs each check in turn on every rank and returns ``{check: None or traceback}``;
tests/test_distributed.py asserts on them. References are single-process computations of the same
thing, made on every rank from the same seeds.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard

import meshbind.binding
import meshbind.validation.rules
from meshbind import (
    BindingError,
    BindingRefusedError,
    CPContext,
    EPContext,
    LayoutContext,
    MaterializationError,
    MeshbindError,
    MeshBinding,
    MeshContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    bind_parallel_modules,
    bound_modules,
    get_family_build_info,
    resolve_plan,
    validate_materialized_modules,
)
from meshbind.world import canonical_axis

from rank_checks import Results, attempt_each, process_group_count

TOLERANCE = 1e-10


def close(actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> None:
    if actual is None:
        raise AssertionError(f"{what}: None (no gradient reached it)")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    difference = (actual - expected).abs().max().item() if actual.numel() else 0.0
    if difference > TOLERANCE:
        raise AssertionError(f"{what}: max difference {difference:.3e} > {TOLERANCE}")


def check_mesh_sizes(sizes: dict[str, int]) -> None:
    world = dist.get_world_size()
    before = process_group_count()
    rejected = (
        ({"dp": world + 1}, "the world size is"),
        ({"dp_shard": world, "ep": 3}, f"ep=3 does not divide dp_shard * cp * tp = {world} * 1 * 1"),
        ({"dp": world, "ep": 2}, f"dp_replicate={world} replicates the experts, it lends them no ranks"),
    )
    for bad, message in rejected:
        try:
            MeshContext.build(**bad)
        except ValueError as error:
            if message not in str(error):
                raise AssertionError(f"unexpected message {error}") from error
        else:
            raise AssertionError(f"MeshContext.build({bad}) did not fail")
    if process_group_count() != before:
        raise AssertionError("a rejected MeshContext.build created a group")
    context = MeshContext.build(**sizes)
    expected_sizes = {"pp": 1, "dp_replicate": 1, "dp_shard": 1, **{canonical_axis(axis): size for axis, size in sizes.items()}}
    if context.axis_sizes() != expected_sizes:
        raise AssertionError(f"axis sizes {context.axis_sizes()}")
    ep_mesh = MeshBinding(context).axis_mesh("ep")
    rank = dist.get_rank()
    expected = list(range(rank - rank % sizes["ep"], rank - rank % sizes["ep"] + sizes["ep"]))
    if ep_mesh.mesh.tolist() != expected:
        raise AssertionError(f"ep is not innermost: {ep_mesh.mesh.tolist()} != {expected}")
    if context.layout_context() != LayoutContext(context.axis_sizes()):
        raise AssertionError("layout_context differs from axis_sizes")
    # The expert mesh's data-parallel axes are derived: edp_replicate = dp_replicate, edp_shard = dp_shard * cp * tp / ep.
    if world == 4:
        for built, expected_dims in (({"dp_shard": 2, "tp": 2, "ep": 2}, (1, 2, 2)), ({"dp": 2, "tp": 2, "ep": 2}, (2, 1, 2))):
            expert_mesh = MeshContext.build(**built).fsdp_moe_mesh
            assert expert_mesh is not None
            dims = tuple(expert_mesh.size(d) for d in range(3))
            if expert_mesh.mesh_dim_names != ("edp_replicate", "edp_shard", "ep") or dims != expected_dims:
                raise AssertionError(f"{built}: {expert_mesh.mesh_dim_names} {dims}, expected {expected_dims}")
    # Without ep > 1 there is no expert mesh, and 'ep' is 1.
    no_experts = MeshContext.build(dp=world)
    no_expert_sizes = {"pp": 1, "dp_replicate": world, "dp_shard": 1, "cp": 1, "tp": 1, "ep": 1}
    if no_experts.fsdp_moe_mesh is not None or no_experts.axis_sizes() != no_expert_sizes:
        raise AssertionError(f"without ep: {no_experts}, {no_experts.axis_sizes()}")
    # An expert mesh over fewer ranks than the device mesh.
    narrow = init_device_mesh("cpu", (world, 1), mesh_dim_names=("x", "ep"))["ep"]
    _expect(
        ValueError, f"the expert mesh spans 1 ranks and the device mesh {world}", lambda: MeshContext(context.device_mesh, narrow)
    )
    # No DeviceMesh, and a DeviceMesh without an 'ep' dimension.
    for not_a_mesh in (5, context.device_mesh):
        wrap = functools.partial(MeshContext, context.device_mesh, not_a_mesh)
        _expect(ValueError, "fsdp_moe_mesh must be a DeviceMesh with an 'ep' dimension", wrap)


def check_axis_mesh(context: MeshContext) -> None:
    before = process_group_count()
    binding = MeshBinding(context)
    for axis in ("dp", "dp_replicate", "dp_shard", "cp", "tp", "ep"):
        mesh = binding.axis_mesh(axis)
        if mesh.ndim != 1 or mesh.size() != context.world.size_of(axis):
            raise AssertionError(f"axis {axis}: {mesh}")
    _expect(ValueError, "no 'pp' axis", lambda: binding.axis_mesh("pp"), code="mesh")
    if process_group_count() != before:
        raise AssertionError(f"axis_mesh created {process_group_count() - before} groups")


def check_cp(context: MeshContext) -> None:
    cp = CPContext(MeshBinding(context).axis_mesh("cp"))
    seq = 8 * cp.size
    positions = cp.positions(seq)
    chunk = seq // (2 * cp.size)
    expected_positions = list(range(cp.rank * chunk, (cp.rank + 1) * chunk))
    expected_positions += list(range((2 * cp.size - 1 - cp.rank) * chunk, (2 * cp.size - cp.rank) * chunk))
    if positions.tolist() != expected_positions:
        raise AssertionError(f"positions {positions.tolist()} != {expected_positions}")
    # A batch of one too: every dim before the sequence then has size 1.
    for batch in (2, 1):
        _check_cp_sequence(cp, batch, seq)
    x = torch.randn(2, seq, 3, dtype=torch.float64)
    try:
        cp.shard_sequence(x[:, :-1], 1)
    except ValueError as error:
        if "2 * cp" not in str(error):
            raise
    else:
        raise AssertionError("an indivisible sequence did not fail")
    _expect(ValueError, f"rank {cp.size} is not in the cp group of size {cp.size}", lambda: cp.positions(seq, rank=cp.size))


def _check_cp_sequence(cp: CPContext, batch: int, seq: int) -> None:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(batch, seq, 3, dtype=torch.float64, generator=generator)
    weights = [torch.randn(batch, seq, 3, dtype=torch.float64, generator=generator) for _ in range(cp.size)]
    positions = cp.positions(seq)
    chunk = seq // (2 * cp.size)
    local = cp.shard_sequence(x, 1)
    close(local, x.index_select(1, positions), "shard_sequence")
    # unshard is the inverse; its backward sums every rank's gradient onto the local tokens.
    local = local.detach().requires_grad_()
    full = cp.unshard_sequence(local, 1)
    close(full, x, "unshard_sequence")
    (full * weights[cp.rank]).sum().backward()
    close(local.grad, sum(weights).index_select(1, positions), "unshard_sequence backward")
    # all_gather: rows in rank order at gathered_positions; backward is a reduce-scatter.
    keys = local.detach().requires_grad_()
    gathered = cp.all_gather(keys, 1)
    close(gathered, x.index_select(1, cp.gathered_positions(seq)), "all_gather")
    gathered_weights = [w.index_select(1, cp.gathered_positions(seq)) for w in weights]
    (gathered * gathered_weights[cp.rank]).sum().backward()
    mine = slice(cp.rank * 2 * chunk, (cp.rank + 1) * 2 * chunk)
    close(keys.grad, sum(gathered_weights)[:, mine], "all_gather backward")


def routed_moe_reference(
    tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """One process, no communication: each token through its K experts, weighted and summed."""
    out = torch.zeros_like(tokens)
    for k in range(expert_ids.size(1)):
        per_choice = torch.einsum("th,thg->tg", tokens, experts[expert_ids[:, k]])
        out = out + per_choice * weights[:, k : k + 1]
    return out


def ep_inputs(rank: int, scenario: str, num_experts: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens, routing and weights of the ``rank``-th rank of the ep group; every rank can
    rebuild every other rank's."""
    generator = torch.Generator().manual_seed(100 + rank)
    tokens_count = {"random": 6 + rank, "skewed": 0 if rank == 1 else 5}[scenario]
    tokens = torch.randn(tokens_count, hidden, dtype=torch.float64, generator=generator)
    if scenario == "random":
        expert_ids = torch.randint(0, num_experts, (tokens_count, 2), generator=generator)
    else:  # every token of rank 0 goes to the last expert; the first experts receive nothing
        expert_ids = torch.full((tokens_count, 2), num_experts - 1, dtype=torch.long)
    weights = torch.rand(tokens_count, 2, dtype=torch.float64, generator=generator)
    return tokens, expert_ids, weights


def check_ep(context: MeshContext, scenario: str) -> None:
    num_experts, hidden = 4 * context.axis_sizes()["ep"], 5
    ep = EPContext(MeshBinding(context).axis_mesh("ep"), num_experts)
    if (ep.num_local_experts, ep.local_expert_start, ep.local_expert_stop) != (4, 4 * ep.rank, 4 * ep.rank + 4):
        raise AssertionError(f"local experts {ep}")
    experts = torch.randn(num_experts, hidden, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    local_experts = experts[ep.local_expert_start : ep.local_expert_stop].clone().requires_grad_()
    group_ranks = MeshBinding(context).axis_mesh("ep").mesh.tolist()
    inputs = {r: ep_inputs(r, scenario, num_experts, hidden) for r in range(len(group_ranks))}
    tokens, expert_ids, weights = inputs[ep.rank]
    tokens = tokens.clone().requires_grad_()
    for not_integers in (expert_ids.double(), expert_ids.bool()):
        _expect(ValueError, "expert_ids must hold integers", functools.partial(ep.dispatch, tokens, not_integers))
    # Every rank refuses before any collective (a rank may have no tokens, so the same bad input on each).
    for out_of_range in (num_experts, -1):
        bad = functools.partial(ep.dispatch, torch.zeros(1, hidden), torch.tensor([[out_of_range]]))
        _expect(ValueError, f"expert ids must lie in [0, {num_experts})", bad)
    mesh = MeshBinding(context).axis_mesh("ep")
    _expect(ValueError, "num_experts must be a positive int, got 0", lambda: EPContext(mesh, 0))
    _expect(ValueError, f"num_experts {ep.size + 1} is not divisible by the ep size", lambda: EPContext(mesh, ep.size + 1))
    routed = ep.dispatch(tokens, expert_ids)
    ids = routed.local_expert_ids
    # Any integer type routes alike; the local ids come back int64 (gloo has no int16, and uint8
    # ids would index the expert weights as a mask).
    for narrow in (torch.int16, torch.uint8):
        again = ep.dispatch(tokens.detach(), expert_ids.to(narrow))
        if again.local_expert_ids.dtype != torch.int64 or not torch.equal(again.local_expert_ids, ids):
            raise AssertionError(f"{narrow} expert ids: {again.local_expert_ids} against {ids}")
        close(again.tokens, routed.tokens.detach(), f"{narrow} dispatch")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= ep.num_local_experts):
        raise AssertionError(f"local expert ids out of range: {ids.tolist()}")
    expert_out = torch.einsum("rh,rhg->rg", routed.tokens, local_experts[ids])
    extra_row = torch.cat([expert_out, expert_out.new_zeros(1, hidden)])
    _expect(ValueError, f"expert_out has {extra_row.size(0)} rows", lambda: ep.combine(extra_row, routed, weights))
    _expect(ValueError, "weights must be", lambda: ep.combine(expert_out, routed, weights.reshape(-1)))
    combined = ep.combine(expert_out, routed, weights)
    close(combined, routed_moe_reference(tokens.detach(), expert_ids, weights, experts), f"{scenario} combine")
    gradient_weights = {
        r: torch.randn(inputs[r][0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in inputs
    }
    (combined * gradient_weights[ep.rank]).sum().backward()
    reference_experts = experts.clone().requires_grad_()
    reference_tokens = {}
    for r, (t, e, w) in inputs.items():
        reference_tokens[r] = t.clone().requires_grad_()
        (routed_moe_reference(reference_tokens[r], e, w, reference_experts) * gradient_weights[r]).sum().backward()
    close(tokens.grad, reference_tokens[ep.rank].grad, f"{scenario} token gradient")
    close(local_experts.grad, reference_experts.grad[ep.local_expert_start : ep.local_expert_stop], f"{scenario} expert gradient")


def accept(**kwargs: Any) -> None:
    return None


class CPAttention(nn.Module):
    """A family module owning the cp protocol; records every bind and unbind."""

    parallel_spec = ParallelModuleSpec("cp_attention", "cp", stages={"forward": ("x",)}, validate=accept)
    events: list[str]

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.events = []
        self.binding: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)

    def parallel_sharding(self, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return ModuleShardingSpec(params={"proj.weight": {"cp": Replicate()}})

    def bind_parallel(self, binding: Any) -> None:
        self.events.append("bind")
        self.binding = binding

    def unbind_parallel(self) -> None:
        self.events.append("unbind")
        self.binding = None


class Experts(nn.Module):
    fail_bind: BaseException | None = None

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(num_experts, 4, 4))
        self.events: list[str] = []

    def forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return tokens

    def bind_parallel(self, binding: Any) -> None:
        if self.fail_bind is not None:
            raise self.fail_bind
        self.events.append("bind")
        self.binding = binding

    def unbind_parallel(self) -> None:
        self.events.append("unbind")


class UnboundExperts(nn.Module):
    """Takes the experts' stage but cannot be bound."""

    def forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return tokens


class Block(nn.Module):
    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.attn = CPAttention()
        self.mlp = Experts(num_experts)


def _experts_plan(num_experts: int, validate_materialized: Callable[..., None] | None = None) -> NativeParallelBindingRequest:
    spec = ParallelModuleSpec(
        "experts",
        "ep",
        stages={"forward": ("tokens", "expert_ids")},
        validate=accept,
        options={"num_experts": num_experts},
        validate_materialized=validate_materialized,
    )
    return NativeParallelBindingRequest(
        ("blocks.*.mlp",), spec, lambda m, f, c: ModuleShardingSpec(params={"w": {"ep": Shard(0)}})
    )


def _expect(error_type: type[BaseException], text: str, call: Callable[[], Any], code: str | None = None) -> BaseException:
    """The error ``call`` raises; with ``code``, a ``BindingRefusedError`` (a ``ValueError``) of that code."""
    try:
        call()
    except error_type as error:
        if text not in str(error):
            raise AssertionError(f"{text!r} not in {error}") from error
        refused = isinstance(error, BindingRefusedError) and isinstance(error, ValueError)
        if code is not None and not (refused and error.code == code):  # type: ignore[attr-defined]
            raise AssertionError(f"{error!r} is no BindingRefusedError of code {code!r}") from error
        return error
    raise AssertionError(f"no {error_type.__name__} ({text})")


def check_binding(context: MeshContext) -> None:
    num_experts = 2 * context.axis_sizes()["ep"]
    model = nn.Module()
    model.blocks = nn.ModuleList(Block(num_experts) for _ in range(2))
    plan = resolve_plan(model, [_experts_plan(num_experts)], context.layout_context())
    before = process_group_count()
    bound = bind_parallel_modules(model, plan, context)
    if process_group_count() != before:
        raise AssertionError(f"binding created {process_group_count() - before} process groups")
    if bound != ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]:
        raise AssertionError(f"bound {bound}")
    attention, experts = model.blocks[0].attn, model.blocks[0].mlp
    if attention.binding.cp_context.size != context.axis_sizes()["cp"] or experts.binding.ep_context.num_experts != num_experts:
        raise AssertionError("bindings carry the wrong contexts")
    if attention.binding.cp_context is not model.blocks[1].attn.binding.cp_context:
        raise AssertionError("one CP context should serve every module on the same mesh")
    layout = get_family_build_info(attention).layout
    if layout is None or not layout.applied or layout.applied_on != context:
        raise AssertionError(f"family layout not applied: {layout}")
    # A resolved family layout is applied exactly when the module is bound with it.
    changed = {"blocks.0.attn": {"params": {"proj.weight": {"tp": Replicate()}}}}
    for overrides, applied in ((None, [True, True]), (changed, [False, True]), (None, [True, True]), (changed, [False, True])):
        resolve_plan(model, [_experts_plan(num_experts)], context.layout_context(), overrides=overrides)
        infos = [get_family_build_info(block.attn) for block in model.blocks]
        if [info.layout is not None and info.layout.applied for info in infos] != applied:
            raise AssertionError(f"after resolving with overrides={overrides}: {[info.layout for info in infos]}")
    if [record.fqn for record in bound_modules(model)] != list(plan.parallel_modules):
        raise AssertionError("the plan is not recorded on the model")
    # Binding the same plan on the same mesh again is a no-op.
    if bind_parallel_modules(model, plan, context) != [] or attention.events != ["bind"]:
        raise AssertionError(f"binding twice called bind_parallel again: {attention.events}")
    if get_family_build_info(attention).layout != layout:
        raise AssertionError("binding the plan again should record its own layout, applied, over the one resolved since")
    # Any other owner is an error naming the module, and nothing changes.
    other = NativeParallelBindingRequest(
        ("blocks.0.mlp",),
        ParallelModuleSpec("other", "ep", stages={"forward": ()}, validate=accept, options={"num_experts": num_experts}),
        lambda m, f, c: ModuleShardingSpec(params={"w": {"ep": Shard(0)}}),
    )
    other_plan = resolve_plan(model, [other], context.layout_context())
    _expect(
        ValueError,
        "'blocks.0.mlp' already has a communication owner",
        lambda: bind_parallel_modules(model, other_plan, context),
        code="owner",
    )
    # The same plan on meshes rebuilt with the same layout (equal, but other groups) is another owner.
    rebuilt = MeshContext.build(**context.axis_sizes())
    if rebuilt != context or rebuilt.same_meshes(context):
        raise AssertionError("a rebuilt mesh context should be equal in layout and other in meshes")
    if MeshContext(context.device_mesh, rebuilt.fsdp_moe_mesh).same_meshes(context):
        raise AssertionError("another expert mesh makes other meshes")
    _expect(
        ValueError,
        "'blocks.0.attn' already has a communication owner",
        lambda: bind_parallel_modules(model, plan, rebuilt),
        code="owner",
    )
    if bind_parallel_modules(model, plan, MeshContext(context.device_mesh, context.fsdp_moe_mesh)) != []:
        raise AssertionError("wrapping the same meshes again should be the same owner")
    validate_materialized_modules(model)
    # A plan checked against another layout binds nothing.
    sizes = context.axis_sizes()
    other_layout = LayoutContext({**sizes, "cp": 2 * sizes["cp"], "ep": 2 * sizes["ep"]})  # a world twice as large
    fresh = nn.Module()
    fresh.blocks = nn.ModuleList(Block(2 * num_experts) for _ in range(2))
    elsewhere = resolve_plan(fresh, [_experts_plan(2 * num_experts)], other_layout)
    _expect(
        ValueError,
        f"resolved for cp={2 * sizes['cp']}, ep={2 * sizes['ep']}, but the meshes have cp={sizes['cp']}, ep={sizes['ep']}",
        lambda: bind_parallel_modules(fresh, elsewhere, context),
        code="mesh",
    )
    if bound_modules(fresh) != () or fresh.blocks[0].attn.events:
        raise AssertionError("a plan for another layout bound something")
    # A second plan adds its records to the first one's.
    second = nn.Module()
    second.blocks = nn.ModuleList(Block(num_experts) for _ in range(2))
    for index in range(2):
        request = dataclasses.replace(_experts_plan(num_experts), match=(f"blocks.{index}.mlp",))
        bind_parallel_modules(second, resolve_plan(second, [request], context.layout_context()), context)
    if [record.fqn for record in bound_modules(second)] != ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]:
        raise AssertionError(f"records of two plans: {[record.fqn for record in bound_modules(second)]}")


def check_binding_is_all_or_nothing(context: MeshContext) -> None:
    num_experts = 2 * context.axis_sizes()["ep"]
    model = nn.Module()
    model.blocks = nn.ModuleList(Block(num_experts) for _ in range(2))
    model.blocks[1].mlp.fail_bind = RuntimeError("no experts here")
    plan = resolve_plan(model, [_experts_plan(num_experts)], context.layout_context())
    before = process_group_count()
    error = _expect(BindingError, "'blocks.1.mlp'", lambda: bind_parallel_modules(model, plan, context))
    if not (isinstance(error, MeshbindError) and isinstance(error, RuntimeError) and error.code == "bind_parallel"):
        raise AssertionError(f"{error!r} is no MeshbindError and RuntimeError of code 'bind_parallel'")
    if "no experts here" not in str(error) or process_group_count() != before:
        raise AssertionError(f"unexpected {error}")
    attentions = [model.blocks[0].attn, model.blocks[1].attn]
    if [a.events for a in attentions] != [["bind", "unbind"], ["bind", "unbind"]]:
        raise AssertionError(f"not restored: {[a.events for a in attentions]}")
    # The module whose bind_parallel raised undoes its own work: it gets no unbind_parallel.
    if [block.mlp.events for block in model.blocks] != [["bind", "unbind"], []]:
        raise AssertionError(f"experts not restored as documented: {[block.mlp.events for block in model.blocks]}")
    for attention in attentions:
        layout = get_family_build_info(attention).layout
        if layout is None or layout.applied:
            raise AssertionError("a family layout was applied by a failed binding")
    if bound_modules(model) != ():
        raise AssertionError("a failed binding recorded the plan")
    # An interrupt is no failure to report, but it unwinds the binding all the same.
    model.blocks[1].mlp.fail_bind = KeyboardInterrupt()
    _expect(KeyboardInterrupt, "", lambda: bind_parallel_modules(model, plan, context))
    if [a.events for a in attentions] != [["bind", "unbind"] * 2] * 2 or bound_modules(model) != ():
        raise AssertionError(f"not restored after an interrupt: {[a.events for a in attentions]}")
    # An offline plan never checked the classes: binding checks rules 1 and 2 for every module
    # first, and binds nothing when one fails (a stage it lacks; no bind_parallel).
    offline = resolve_plan([name for name, _ in model.named_modules()], [_experts_plan(num_experts)], context.layout_context())
    other = nn.Module()
    other.blocks = nn.ModuleList(Block(num_experts) for _ in range(2))
    for replacement, text in (
        (nn.Identity(), "'blocks.1.mlp' (Identity) cannot be bound as experts v1 (ep): [stage] stage Identity.forward"),
        (UnboundExperts(), "'blocks.1.mlp' (UnboundExperts) cannot be bound as experts v1 (ep): [binding]"),
    ):
        other.blocks[1].mlp = replacement
        _expect(ValueError, text, lambda: bind_parallel_modules(other, offline, context), code="class")
        # A plan resolved over another model proved the rules for the classes it met there only.
        _expect(ValueError, text, lambda: bind_parallel_modules(other, plan, context), code="class")
        if other.blocks[0].attn.events or other.blocks[0].mlp.events or bound_modules(other) != ():
            raise AssertionError("a plan that cannot bind every module bound some")
    # A plan naming a module this model does not have binds nothing, and says where the path ends.
    missing = nn.Module()
    missing.blocks = nn.ModuleList(Block(num_experts) for _ in range(2))
    del missing.blocks[1].mlp
    text = "the plan names 'blocks.1.mlp', which this model does not have: 'blocks.1' has no child 'mlp'"
    _expect(ValueError, text, lambda: bind_parallel_modules(missing, plan, context), code="module")
    if missing.blocks[0].attn.events or missing.blocks[0].mlp.events or bound_modules(missing) != ():
        raise AssertionError("a plan naming a missing module bound some")
    # Restored means rebindable: once the module is fixed, the same plan binds. Resolution proved
    # every class of this model: binding does not check one again.
    model.blocks[1].mlp.fail_bind = None
    checked: list[type] = []
    original = meshbind.validation.rules.class_failure
    meshbind.validation.rules.class_failure = lambda cls, spec: checked.append(cls)  # type: ignore[assignment,func-returns-value]
    try:
        if len(bind_parallel_modules(model, plan, context)) != 4:
            raise AssertionError("the restored model did not bind")
    finally:
        meshbind.validation.rules.class_failure = original
    if checked:
        raise AssertionError(f"binding checked the classes resolution proved: {checked}")


def check_validate_materialized(context: MeshContext) -> None:
    num_experts = 2 * context.axis_sizes()["ep"]

    def nonzero(*, module: nn.Module, binding: Any) -> None:
        if binding is None or binding.ep_context is None:
            raise AssertionError("no binding handed to validate_materialized")
        if not module.w.abs().sum() > 0:
            raise ValueError("expert weights were never initialised")

    model = nn.Module()
    model.blocks = nn.ModuleList(Block(num_experts) for _ in range(3))
    plan = resolve_plan(model, [_experts_plan(num_experts, nonzero)], context.layout_context())
    bind_parallel_modules(model, plan, context)
    with torch.no_grad():
        model.blocks[1].mlp.w.fill_(1.0)
    error = _expect(MaterializationError, "2 modules failed validate_materialized", lambda: validate_materialized_modules(model))
    if [fqn for fqn, _ in error.failures] != ["blocks.0.mlp", "blocks.2.mlp"]:  # type: ignore[attr-defined]
        raise AssertionError(f"failures {error}")
    # A recorded module taken out of the model since binding is a failure that says so.
    del model.blocks[0].mlp
    _expect(
        MaterializationError,
        "'blocks.0.mlp': BindingRefusedError: the plan names 'blocks.0.mlp', which this model does not have",
        lambda: validate_materialized_modules(model),
    )
    # A verdict returned instead of raised is a failure too: a returned False would pass unseen.
    verdict = nn.Module()
    verdict.blocks = nn.ModuleList(Block(num_experts) for _ in range(1))
    returns_false = _experts_plan(num_experts, lambda **kwargs: False)
    bind_parallel_modules(verdict, resolve_plan(verdict, [returns_false], context.layout_context()), context)
    _expect(MaterializationError, "validate_materialized returned False", lambda: validate_materialized_modules(verdict))


def check_wrappers(context: MeshContext) -> None:
    """torchtitan's order: bind, then activation checkpointing, ``torch.compile`` and FSDP2, then
    ``validate_materialized_modules``. The recorded FQNs find the bound modules through the wrappers."""
    num_experts = 2 * context.axis_sizes()["ep"]
    checked: list[nn.Module] = []

    def record(*, module: nn.Module, binding: Any) -> None:
        checked.append(module)

    model = nn.Module()
    model.blocks = nn.ModuleList(Block(num_experts) for _ in range(2))
    plan = resolve_plan(model, [_experts_plan(num_experts, record)], context.layout_context())
    bind_parallel_modules(model, plan, context)
    experts = [block.mlp for block in model.blocks]
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    model.blocks[1].mlp = torch.compile(model.blocks[1].mlp)
    fully_shard(model, mesh=MeshBinding(context).axis_mesh("dp_replicate"))
    compiled = torch.compile(model)
    validate_materialized_modules(compiled)
    if list(map(id, checked)) != list(map(id, experts)):
        raise AssertionError(f"validate_materialized saw {checked}, not the bound experts")
    if [record.fqn for record in bound_modules(compiled)] != ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]:
        raise AssertionError(f"records {bound_modules(compiled)}")
    if bind_parallel_modules(compiled, plan, context):
        raise AssertionError("binding the same plan again through the wrappers bound modules again")


def run_checks(sizes: dict[str, int]) -> Results:
    """Every check on this rank: ``{name: None}`` when it passed, else its traceback."""
    results = attempt_each({"mesh_sizes": lambda: check_mesh_sizes(sizes)})
    context = MeshContext.build(**sizes)
    return results | attempt_each(
        {
            "axis_mesh": lambda: check_axis_mesh(context),
            "cp": lambda: check_cp(context),
            "ep_random": lambda: check_ep(context, "random"),
            "ep_skewed": lambda: check_ep(context, "skewed"),
            "binding": lambda: check_binding(context),
            "binding_all_or_nothing": lambda: check_binding_is_all_or_nothing(context),
            "validate_materialized": lambda: check_validate_materialized(context),
            "wrappers": lambda: check_wrappers(context),
        }
    )


def exit_on_rank_one() -> None:
    """Rank 1 dies without a word; rank 0 returns and waits for it."""
    if dist.get_rank() == 1:
        os._exit(3)
