"""One training step of the planned model, traced: torch's ``FakeTensorMode`` holds no data, torch's
fake process group runs no collective, and torch's memory trackers (``MemTracker``, or
``FSDPMemTracker`` under FSDP) count every storage the step allocates and frees.

The plan is really applied, as on a real rank: layouts (TP/EP DTensors), binding (CP/EP
contexts), activation checkpointing (torch's ``checkpoint_wrapper``) and FSDP2 (torch's
``fully_shard``), on meshes of the world's shape over the fake group. Only one rank is traced per
class of ranks holding alike shards (``plan_report``'s rank groups).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from meshbind.binding import bind_parallel_modules, submodule
from meshbind.errors import MeshbindError
from meshbind.fsdp import apply_fully_shard
from meshbind.interop import HF_PROTOCOL, torch_plans
from meshbind.layouts import apply_layouts
from meshbind.memory.depth import TRACED_DEPTHS, alike_run, extrapolated, truncated
from meshbind.memory.result import KINDS, RankClassMemory, StepMemory, StepSettings
from meshbind.memory.routing import Routing, assuming
from meshbind.mesh import MeshContext
from meshbind.report import RankGroup, plan_report
from meshbind.resolution import resolve_plan
from meshbind.resolution.plan import ParallelPlan
from meshbind.specs import FullyShard, LayoutContext, NativeParallelBindingRequest
from meshbind.world import DENSE_AXES, EXPERT_AXES, World

ACTIVATION_CHECKPOINTING = ("none", "full")
TRACED_OPTIMIZERS = ("none", "sgd-momentum", "adam")
DEVICES = ("cuda", "cpu")

StepInputs = Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]
"""``inputs(batch, seq_len)`` → the positional and keyword arguments of one forward call."""


class StepMemoryError(MeshbindError):
    """A step that cannot be traced: the reason, and the module or setting that stops it."""


def step_memory(
    build: Callable[[], nn.Module],
    requests: Sequence[NativeParallelBindingRequest],
    context: LayoutContext,
    *,
    batch: int,
    seq_len: int,
    fully_shard: FullyShard | None = None,
    optimizer: str = "adam",
    activation_checkpointing: str = "none",
    device: str = "cuda",
    device_memory: int | None = None,
    routing: Routing | None = None,
    inputs: StepInputs | None = None,
    alike_layers: bool = True,
) -> StepMemory:
    """The peak bytes of one training step (forward, backward, optimizer step) on each class of
    ranks, with what is live at the peak and where it falls.

    ``build()`` makes the model (called under ``torch.device("meta")``, once per traced rank);
    ``requests``, ``context`` and ``fully_shard`` are ``resolve_plan``'s. ``batch`` is the
    sequences of one data-parallel rank, ``seq_len`` their length. ``inputs(batch, seq_len)``
    gives one forward call's arguments; by default token ids ``[batch, seq_len]`` are passed as
    ``input_ids=`` and ``labels=`` (with ``use_cache=False``) when ``forward`` takes ``input_ids``,
    else as two positional arguments (the ids and the targets). The output is the loss, or has a ``.loss``.

    The step is traced with no weights and no collectives; it needs no process group of its own
    and refuses to run inside one (a fake group takes the default group's place while tracing).
    With ``alike_layers`` (the default), a model whose blocks end in more than five alike ones is
    traced at three, four and five of them and extrapolated where that is exact
    (``memory/depth.py``), else traced whole.
    """
    settings = StepSettings(
        batch=batch,
        seq_len=seq_len,
        optimizer=optimizer,
        activation_checkpointing=activation_checkpointing,
        device=device,
        device_memory=device_memory,
        routing=routing if routing is not None else Routing(),
    )
    _check_settings(settings)
    if not isinstance(context, LayoutContext):
        raise TypeError(f"context must be a LayoutContext, got {type(context).__name__}")
    if dist.is_available() and dist.is_initialized():
        raise StepMemoryError(
            "step_memory traces over torch's fake process group and cannot while a process group is "
            "initialised: call it before init_process_group, or in a process of its own"
        )
    started = time.perf_counter()
    models = _Models(build, alike_layers)
    assert models.unused is not None
    groups = plan_report(models.unused, _resolved(models.unused, requests, context, fully_shard), optimizer="none").rank_groups
    classes = [_trace_class(models, (requests, context, fully_shard), group, settings, inputs) for group in groups]
    return StepMemory(settings, context.world, tuple(classes), time.perf_counter() - started)


class _Models:
    """The models the traces apply the plan to, each its own: the model first built (once), a
    copy of it at each traced depth, and a new build where a whole model is traced again. The
    copies are taken from the model as built, before resolution marks it."""

    def __init__(self, build: Callable[[], nn.Module], alike_layers: bool) -> None:
        self.build = build
        with torch.device("meta"):
            self.unused: nn.Module | None = build()
        self.run = alike_run(self.unused) if alike_layers else None
        self.deepest = truncated(self.unused, self.run, TRACED_DEPTHS[-1]) if self.run is not None else None

    def kept(self, blocks: int) -> nn.Module:
        assert self.run is not None and self.deepest is not None
        return truncated(self.deepest, self.run, blocks)

    def whole(self) -> nn.Module:
        if self.unused is not None:
            model, self.unused = self.unused, None
            return model
        with torch.device("meta"):
            return self.build()


Planning = tuple[Any, LayoutContext, "FullyShard | None"]
"""``resolve_plan``'s requests, context and FSDP units."""


def _resolved(model: nn.Module, requests: Any, context: LayoutContext, fully_shard: FullyShard | None) -> ParallelPlan:
    """The plan for ``model``. A transformers model's own plans (``from_hf_plan``) are read again
    from each model: each traced model is a copy of its own."""
    hf_plans = sys.modules.get("meshbind.interop.hf_plans")  # loaded when a plan was read from transformers
    if hf_plans is not None and isinstance(requests, hf_plans.HFPlan):
        requests = hf_plans.from_hf_plan(model, strict=requests.strict)
    return resolve_plan(model, requests, context, fully_shard=fully_shard)


def _trace_class(
    models: _Models, planning: Planning, group: RankGroup, settings: StepSettings, inputs: StepInputs | None
) -> RankClassMemory:
    """One rank of ``group`` traced: at three depths of the alike run when that is exact, else whole."""
    started = time.perf_counter()
    run = models.run
    if run is not None:
        traced = []
        for kept in TRACED_DEPTHS:
            model = models.kept(kept)
            traced.append(_trace_rank(model, _resolved(model, *planning), group.first, settings, inputs))
        figures = [{"peak": peak.total, **peak.kinds} for peak in traced]
        full = extrapolated(figures, run.count)
        if full is not None:
            deepest = traced[-1]
            depths = ", ".join(map(str, TRACED_DEPTHS[:-1])) + f" and {TRACED_DEPTHS[-1]}"
            return RankClassMemory(
                first_rank=group.first,
                ranks=group.count,
                peak_bytes=full.pop("peak"),
                live_at_peak=full,
                peak_module=run.full_name(deepest.module, traced[-2].module),
                peak_phase=deepest.phase,
                traced=f"{depths} of the {run.count} alike blocks of {run.list_fqn}, extrapolated (exact)",
                seconds=time.perf_counter() - started,
            )
    model = models.whole()
    peak = _trace_rank(model, _resolved(model, *planning), group.first, settings, inputs)
    return RankClassMemory(
        first_rank=group.first,
        ranks=group.count,
        peak_bytes=peak.total,
        live_at_peak=peak.kinds,
        peak_module=peak.module,
        peak_phase=peak.phase,
        traced="the whole model",
        seconds=time.perf_counter() - started,
    )


def _check_settings(settings: StepSettings) -> None:
    for name in ("batch", "seq_len"):
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if settings.optimizer not in TRACED_OPTIMIZERS:
        raise ValueError(f"the traced optimizer must be one of {', '.join(TRACED_OPTIMIZERS)}, got {settings.optimizer!r}")
    if settings.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"activation_checkpointing must be one of {', '.join(ACTIVATION_CHECKPOINTING)}, "
            f"got {settings.activation_checkpointing!r}"
        )
    if settings.device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {settings.device!r}")
    if settings.device_memory is not None and (not isinstance(settings.device_memory, int) or settings.device_memory < 1):
        raise ValueError(f"device_memory must be a positive number of bytes, got {settings.device_memory!r}")
    if not isinstance(settings.routing, Routing):
        raise TypeError(f"routing must be a Routing, got {type(settings.routing).__name__}")


@contextmanager
def _fake_world(rank: int, world: World) -> Iterator[MeshContext]:
    """The default group replaced by torch's fake one for ``rank``, and both meshes over it (the
    expert mesh even at ``ep`` 1: expert modules bind over one-rank groups there)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world.size)
    try:
        device_mesh = init_device_mesh("cpu", world.dense_shape, mesh_dim_names=DENSE_AXES)
        expert_mesh = init_device_mesh("cpu", world.expert_shape, mesh_dim_names=EXPERT_AXES)
        yield MeshContext(device_mesh, expert_mesh)
    finally:
        dist.destroy_process_group()


@contextmanager
def _without_torch_advice() -> Iterator[None]:
    """torch.distributed's warnings are for the user's own run, which will give them again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
        yield


def apply_plan(
    model: nn.Module,
    plan: ParallelPlan,
    mesh_context: MeshContext,
    activation_checkpointing: str,
    recompute_context: Callable[[], Any] | None = None,
) -> None:
    """The plan applied as a training job applies it: layouts, binding, activation checkpointing
    (``checkpoint_units``), then FSDP. ``recompute_context()``, when given, is entered around each
    checkpointed block's forward and its recomputation (torch's ``context_fn``): the backward does
    not run under the modes the step was started in."""
    protocols = {spec.protocol for spec in plan.parallel_modules.values()}
    if HF_PROTOCOL in protocols:
        from meshbind.interop import hf_plans, hf_routing  # transformers, loaded only for its own plans

        world = mesh_context.world
        ep_mesh = mesh_context.fsdp_moe_mesh["ep"] if mesh_context.fsdp_moe_mesh is not None and world.ep > 1 else None
        tp_mesh = mesh_context.device_mesh["tp"]
        hf_plans.apply_hf_plan(model, plan, tp_mesh=tp_mesh, ep_mesh=ep_mesh, ep_implementation=hf_routing.ASSUMED_ROUTING_EP)
    elif torch_plans.PROTOCOL in protocols:
        torch_plans.parallelize_checked(model, plan, mesh_context.device_mesh["tp"])
    else:
        apply_layouts(model, plan, mesh_context)
        bind_parallel_modules(model, plan, mesh_context)
    if activation_checkpointing == "full":
        wrapping: dict[str, Any] = {}
        if recompute_context is not None:
            enter = recompute_context
            wrapping["context_fn"] = lambda: (enter(), enter())
        for fqn in checkpoint_units(model, plan):
            parent_fqn, _, name = fqn.rpartition(".")
            parent = submodule(model, parent_fqn)
            block = parent._modules[name]
            assert block is not None
            setattr(parent, name, checkpoint_wrapper(block, **wrapping))
    if plan.fsdp is not None:
        apply_fully_shard(model, plan, mesh_context)


def checkpoint_units(model: nn.Module, plan: ParallelPlan) -> list[str]:
    """What full activation checkpointing wraps: each FSDP unit below the root that no other such
    unit contains (a transformer block, not also its experts inside it); without FSDP units, each
    module of the model's longest ``ModuleList`` (its blocks, as torchtitan wraps them)."""
    if plan.fsdp is not None:
        fqns = sorted(unit.fqn for unit in plan.fsdp.units if unit.fqn)
        outermost: list[str] = []
        for fqn in fqns:  # sorted: a unit comes right after any unit holding it
            if not outermost or not fqn.startswith(outermost[-1] + "."):
                outermost.append(fqn)
        if outermost:
            return outermost
    lists = [(fqn, module) for fqn, module in model.named_modules() if isinstance(module, nn.ModuleList) and len(module)]
    if not lists:
        raise StepMemoryError(
            "activation checkpointing full wraps the FSDP units or the blocks of a ModuleList: "
            f"{type(model).__name__} has neither"
        )
    fqn, blocks = max(lists, key=lambda item: len(item[1]))
    return [f"{fqn}.{name}" if fqn else name for name in blocks._modules]


def default_inputs(model: nn.Module) -> StepInputs:
    """Token ids as ``input_ids=``/``labels=`` (and ``use_cache=False``) for a forward that takes
    ``input_ids``, else as two positional arguments. Zeros: a fake tensor's values are never read."""
    taken = inspect.signature(model.forward).parameters
    # Training keeps no key/value cache (a recomputed layer would append to it twice).
    no_cache = {"use_cache": False} if "use_cache" in taken else {}

    def inputs(batch: int, seq_len: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = torch.zeros(batch, seq_len, dtype=torch.long)
        if "input_ids" in taken:
            return (), {"input_ids": ids, "labels": ids.clone(), **no_cache}
        return (ids, ids.clone()), {}

    return inputs


def make_optimizer(model: nn.Module, name: str, device: str) -> torch.optim.Optimizer | None:
    """The optimizer torch would run on ``device``: foreach on CUDA (torch's default there, whose
    grouped temporaries count) unless the parameters mix DTensors and plain tensors, one parameter
    at a time on the CPU."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    # torch's foreach kernels take a list of one kind: DTensors, or plain tensors.
    foreach = device == "cuda" and len({isinstance(p, DTensor) for p in parameters}) == 1
    if name == "sgd-momentum":
        return torch.optim.SGD(parameters, lr=0.01, momentum=0.9, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=0.01, foreach=foreach)
    return None


def make_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """The optimizer's state as it is at every step after the first: made by one step on zero
    gradients, the gradients then dropped."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def training_step(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Forward, backward, optimizer step, gradients dropped: the step both the trace and a real
    measurement run."""
    output = model(*args, **kwargs)
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise StepMemoryError(
            f"{type(model).__name__}.forward must return the loss (a 0-d tensor) or an output with a .loss; "
            f"got {type(output).__name__}"
        )
    loss.backward()  # type: ignore[no-untyped-call]
    del output, loss
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _trace_rank(model: nn.Module, plan: ParallelPlan, rank: int, settings: StepSettings, inputs: StepInputs | None) -> _Peak:
    with _without_torch_advice(), _fake_world(rank, plan.context.world) as mesh_context:
        on_device = _CudaAttention if settings.device == "cuda" else contextlib.nullcontext
        apply_plan(model, plan, mesh_context, settings.activation_checkpointing, on_device)
        step_inputs = inputs or default_inputs(model)
        with FakeTensorMode(allow_non_fake_inputs=True), assuming(settings.routing), on_device():
            model.to_empty(device="cpu")
            optimizer = make_optimizer(model, settings.optimizer, settings.device)
            make_optimizer_state(optimizer)
            args, kwargs = step_inputs(settings.batch, settings.seq_len)
            tracker = _tracker(model, optimizer, (args, kwargs))
            try:
                with tracker:
                    training_step(model, optimizer, args, kwargs)
            except StepMemoryError:
                raise
            except Exception as error:
                raise StepMemoryError(_untraceable(error, tracker)) from error
    return tracker.peak()


class _CudaAttention(TorchFunctionMode):
    """For a CUDA target, ``scaled_dot_product_attention`` is traced as CUDA's memory-efficient
    kernel: it keeps, as the flash kernel does, the output and a float32 logsumexp per query, never
    the probabilities. On the CPU torch picks its math path for some shapes (a value head size
    other than the query's, as MLA's), which keeps them."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is nn.functional.scaled_dot_product_attention and args and args[0].dim() == 4:
            return _efficient_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if enable_gqa and key.size(1) != query.size(1):
        groups = query.size(1) // key.size(1)
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:  # as SDPA turns a boolean mask into a bias for this kernel
            bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill(~bias, float("-inf"))
        bias = bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))
    output: torch.Tensor = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, query.requires_grad, dropout_p, is_causal, scale=scale
    )[0]
    return output


def _untraceable(error: Exception, tracker: Any) -> str:
    where = tracker.current_module() or "the model"
    return (
        f"one training step cannot be traced with fake tensors: {where} ({tracker.current_phase()}) raised "
        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    )


class _Peak(NamedTuple):
    total: int
    kinds: dict[str, int]
    module: str
    phase: str


_KIND_OF = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Unsharded Param": "unsharded_parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "unsharded_gradients",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
    "Optstate": "optimizer_state",
    "OptState": "optimizer_state",
    "Inputs": "inputs",
    "Other": "inputs",
}


class _PeakPlace:
    """Where the step's peak falls: the innermost module running and the phase, kept each time
    the tracker's peak rises."""

    _mod_tracker: Any
    _in_opt: bool
    _peak_mem: dict[torch.device, int]
    _peak_mem_snap: dict[torch.device, dict[Any, int]]
    _root_name: str

    def _update_peak_stats(self, peak_state: Any) -> None:
        before = sum(self._peak_mem.values())
        super()._update_peak_stats(peak_state)  # type: ignore[misc]
        if sum(self._peak_mem.values()) > before:
            self._peak_place = (self.current_module(), self.current_phase())

    def current_module(self) -> str:
        running = [name for name in self._mod_tracker.parents if name != "Global"]
        if not running:
            return ""
        innermost = max(running, key=lambda name: name.count("."))
        fqn = innermost.partition(".")[2] if "." in innermost else ""
        return fqn.replace("._checkpoint_wrapped_module", "") or "<root>"

    def current_phase(self) -> str:
        if self._in_opt:
            return "optimizer step"
        return "backward" if self._mod_tracker.is_bw else "forward"

    def peak(self) -> _Peak:
        snapshot: dict[str, int] = dict.fromkeys(KINDS, 0)
        total = 0
        for device_snapshot in self._peak_mem_snap.values():
            for kind, size in device_snapshot.items():
                if kind == "Total":
                    total += size
                else:
                    snapshot[_KIND_OF[str(kind.value)]] += size
        module, phase = getattr(self, "_peak_place", ("<root>", "forward"))
        return _Peak(total, snapshot, module, phase)


class _StepTracker(_PeakPlace, MemTracker):  # type: ignore[no-untyped-call]
    pass


class _FSDPStepTracker(_PeakPlace, FSDPMemTracker):  # type: ignore[no-untyped-call]
    pass


def _tracker(model: nn.Module, optimizer: torch.optim.Optimizer | None, inputs: Any) -> _StepTracker | _FSDPStepTracker:
    """``FSDPMemTracker`` when the root is an FSDP unit (it names the all-gather and reduce-scatter
    buffers), ``MemTracker`` otherwise; the parameters, optimizer state and inputs made before the
    step are counted from its start."""
    if isinstance(model, FSDPModule):
        fsdp_tracker = _FSDPStepTracker(model, optimizer)
        fsdp_tracker.track_inputs(inputs)
        if optimizer is not None:  # FSDPMemTracker counts the state only after the step made it
            fsdp_tracker._track_optimizer_states(_FSDPRefType.OPT, optimizer)
        return fsdp_tracker
    tracker = _StepTracker()
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    tracker.track_external(*[leaf for leaf in tree_leaves(inputs) if isinstance(leaf, torch.Tensor)])
    return tracker
