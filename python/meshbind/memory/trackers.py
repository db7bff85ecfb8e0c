"""torch's memory trackers for one step: ``MemTracker``, or ``FSDPMemTracker`` under FSDP, and
where each one's peak falls."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._pytree import tree_leaves

from meshbind.memory.backward_waits import module_pre_forward
from meshbind.memory.fake_step import step_errors
from meshbind.memory.result import KINDS

TRACED_DEVICE = torch.device("cpu")
"""Where a trace puts the model: on the CPU under ``FakeTensorMode``, for either target device."""


Place = tuple[str, str, str]
"""Where a step is: the innermost module running (``"<root>"``: the model itself or none), the
phase, and the last block of the model's layer list the phase has run (``""``: none yet), which
tells apart the moments of one module before its blocks, between them and after them."""


class Peak(NamedTuple):
    total: int
    kinds: dict[str, int]
    module: str
    phase: str
    places: dict[Place, dict[str, int]]
    """For each place the step ran in, the most bytes live there (``"peak"``) and each kind then."""
    action: str
    """Under a pipeline, the schedule's action running at the peak (``""`` otherwise)."""


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


class StepPart(NamedTuple):
    """A part of a traced step (``_PeakPlace.cut``): the live bytes by kind (``Peak.kinds``, with
    ``"peak"`` their total) as it begins, at its highest and as it ends; at its highest, the module
    and phase, the action running and how many actions had begun within the part."""

    begin: dict[str, int]
    highest: dict[str, int]
    end: dict[str, int]
    module: str
    phase: str
    action: str
    actions_begun: int


@dataclass
class _OpenPart:
    """The part of the step being counted: snapshots as the trackers keep them."""

    begin: dict[Any, int]
    highest: dict[Any, int]
    place: Place
    action: str
    actions_begun: int

    def ended(self, end: dict[Any, int]) -> StepPart:
        module, phase, _ = self.place
        begin, highest = _figures(self.begin), _figures(self.highest)
        return StepPart(begin, highest, _figures(end), module, phase, self.action, self.actions_begun)


_DEVICE_QUERY = torch.ops.prim.device.default


class _PeakPlace:
    """Where the step's peak falls, and the most bytes live in each place the step runs in (its
    module and phase), kept after each op; nothing counted while ``untracked``
    (``untracked_shape_propagation``). Cut into parts (``cut``), each part's own highest too."""

    untracked = False
    action = ""
    """What a pipeline's schedule is running (``begin_action``): the peak names it."""

    def __init__(self, *args: Any, blocks: str | None = None, roots: Sequence[nn.Module] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._places: dict[Place, dict[Any, int]] = {}
        self._peak_place: Place = ("<root>", "forward", "")
        self._peak_action = ""
        self._roots = roots
        self._block_prefix = None if blocks is None else f"{blocks}." if blocks else ""
        self._last_block: dict[str, str] = {}
        self._module_and_block: dict[frozenset[str], tuple[str, str]] = {}
        self._mod_tracker._fw_pre_hook = module_pre_forward(self._mod_tracker)
        self._parts: list[StepPart] = []
        self._open: _OpenPart | None = None
        self._actions_begun = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # A fake tensor's device is asked of every mode (most of a step's dispatches): it makes
        # and frees nothing, so torch's trackers need not see it.
        if self.untracked or func is _DEVICE_QUERY:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]

    _mod_tracker: Any
    memory_tracking: Any
    _in_opt: bool
    _peak_mem: dict[torch.device, int]
    _peak_mem_snap: dict[torch.device, dict[Any, int]]
    _curr_mem_snap: dict[torch.device, dict[Any, int]]
    _root_name: str

    def _update_peak_stats(self, peak_state: Any) -> None:
        # torch's own walks every module it tracks after each op to keep per-module peaks, which
        # nothing here reads: only the step's peak is kept.
        before = self._peak_mem.get(TRACED_DEVICE, 0)
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)
        current = self._curr_mem_snap.get(TRACED_DEVICE)
        if current is None:
            return
        place = self._place()
        if self._peak_mem.get(TRACED_DEVICE, 0) > before:
            self._peak_place = place
            self._peak_action = self.action
        if place not in self._places or current["Total"] > self._places[place]["Total"]:
            self._places[place] = dict(current)
        if self._open is not None and current["Total"] > self._open.highest.get("Total", 0):
            self._open.highest, self._open.place = dict(current), place
            self._open.action, self._open.actions_begun = self.action, self._actions_begun

    def weight_gradients_made(self, stage: nn.Module) -> None:
        """A split backward's weight half has made ``stage``'s parameters' gradients (``_FSDPStepTracker``)."""

    def begin_action(self, action: str) -> None:
        """A pipeline schedule's action begins (``action`` names it)."""
        self.action = action
        self._actions_begun += 1

    def cut(self) -> None:
        """Ends the part of the step being counted, if any, and begins the next here."""
        current = dict(self._curr_mem_snap.get(TRACED_DEVICE, {}))
        if self._open is not None:
            self._parts.append(self._open.ended(current))
        self._open = _OpenPart(current, current, self._place(), self.action, 0)
        self._actions_begun = 0

    def parts(self) -> list[StepPart]:
        """The step's parts, in order: between one ``cut`` and the next, and from the last to the step's end."""
        if self._open is not None:
            self._parts.append(self._open.ended(dict(self._curr_mem_snap.get(TRACED_DEVICE, {}))))
            self._open = None
        return self._parts

    def _place(self) -> Place:
        # Asked after every op: the running modules change only at module hooks, so each set of
        # them is read once (its innermost module, and the block that module lies in).
        running = frozenset(self._mod_tracker.parents)
        if (known := self._module_and_block.get(running)) is None:
            known = self._module_and_block[running] = self._innermost_and_block()
        module, block = known
        phase = self.current_phase()
        if block:
            self._last_block[phase] = block
        return module, phase, self._last_block.get(phase, "")

    def _innermost_and_block(self) -> tuple[str, str]:
        """The innermost running module, and the block of the layer list it lies in ("": none)."""
        module, prefix = self.current_module() or "<root>", self._block_prefix
        if prefix is not None and module.startswith(prefix):
            number = module[len(prefix) :].partition(".")[0]
            if number.isdigit():
                return module, prefix + number
        return module, ""

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        # A pipeline stage's root runs forward once per microbatch, which the trackers refuse as a
        # second step; its own statistics (not the step's totals) start again with each microbatch.
        if any(module is root for root in self._roots) and not self._mod_tracker.is_bw:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)  # type: ignore[misc]

    def current_module(self) -> str:
        running = [name for name in self._mod_tracker.parents if name != "Global"]
        if not running:
            return ""
        # `parents` is a set: among equally deep modules (a checkpointed block's recomputation runs
        # inside another's backward), the name decides, not the set's hash order.
        innermost = max(running, key=lambda name: (name.count("."), name))
        fqn = innermost.partition(".")[2] if "." in innermost else ""
        return fqn.replace("._checkpoint_wrapped_module", "") or "<root>"

    def current_phase(self) -> str:
        if self._in_opt:
            return "optimizer step"
        return "backward" if self._mod_tracker.is_bw else "forward"

    def peak(self) -> Peak:
        # The traced device's snapshot alone, taken at its own peak: meta tensors (which transformers
        # makes to read strides) hold no memory, and another device's peak falls at another moment.
        figures = _figures(self._peak_mem_snap.get(TRACED_DEVICE, {}))
        total = figures.pop("peak")
        module, phase, _ = self._peak_place
        places = {place: _figures(snapshot) for place, snapshot in self._places.items()}
        return Peak(total, figures, module, phase, places, self._peak_action)


def _figures(snapshot: dict[Any, int]) -> dict[str, int]:
    """A tracker's snapshot as the answer's figures: ``"peak"`` (its total) and each kind."""
    figures: dict[str, int] = {"peak": 0, **dict.fromkeys(KINDS, 0)}
    for kind, size in snapshot.items():
        if kind == "Total":
            figures["peak"] = size
        else:
            figures[_KIND_OF[str(kind.value)]] += size
    return figures


class _StepTracker(_PeakPlace, MemTracker):  # type: ignore[no-untyped-call]
    pass


class _FSDPStepTracker(_PeakPlace, FSDPMemTracker):  # type: ignore[no-untyped-call]
    def _fsdp_state_pre_forward(self, fsdp_mod: FSDPModule, orig_fsdp_state_pre_fw: Any) -> Any:
        # As `_pre_fw_hook`: FSDP's own pre-forward of a stage's root runs once per microbatch.
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig_fsdp_state_pre_fw)
        if not any(fsdp_mod is root for root in self._roots):  # type: ignore[comparison-overlap]
            return inner

        def again(*args: Any, **kwargs: Any) -> Any:
            if not self._mod_tracker.is_bw:
                self.memory_tracking.pop(fsdp_mod, None)
            return inner(*args, **kwargs)

        return again

    def weight_gradients_made(self, stage: nn.Module) -> None:
        # torch's tracker names FSDP's unsharded gradients at FSDP's post-backward, which a split
        # backward runs with its input half: those its weight half makes would be temporaries until
        # the stage's next backward. They are named where they are made.
        for module in stage.modules():
            if isinstance(module, FSDPModule) and (group := module._get_fsdp_state()._fsdp_param_group) is not None:
                for fsdp_param in group.fsdp_params:
                    if (gradient := fsdp_param._unsharded_param.grad) is not None:
                        self._update_and_maybe_create_winfos(gradient, _FSDPRefType.UNSHARDED_GRAD, update_existing=True)


@contextmanager
def untracked_shape_propagation(tracker: _StepTracker | _FSDPStepTracker) -> Iterator[None]:
    """DTensor learns an op's output shape by running it once on fake global tensors (then caches
    it): no memory a real step allocates, but the tracker would count it, in the first step of a
    process only. It runs untracked here."""
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def untracked(self: ShardingPropagator, op_schema: Any) -> Any:
        tracker.untracked = True
        try:
            return propagate(self, op_schema)
        finally:
            tracker.untracked = False

    ShardingPropagator._propagate_tensor_meta_non_cached = untracked  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]


def step_tracker(
    roots: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None, inputs: Any, blocks: str | None = None
) -> _StepTracker | _FSDPStepTracker:
    """``FSDPMemTracker`` when the roots (the model, or a pipeline rank's stage models) are FSDP
    units (it names the all-gather and reduce-scatter buffers), ``MemTracker`` otherwise; the
    parameters, optimizer state and inputs made before the step are counted from its start.
    ``blocks`` is the FQN of the model's layer list, if any: its blocks tell the places of the step
    apart (``Place``)."""
    if all(isinstance(root, FSDPModule) for root in roots):
        fsdp_tracker = _FSDPStepTracker(roots[0], optimizer, blocks=blocks, roots=roots)
        if len(roots) > 1:
            fsdp_tracker._root_mod = nn.ModuleList(roots)  # type: ignore[assignment]  # it only walks the root's modules and buffers
        fsdp_tracker.track_inputs(inputs)
        if optimizer is not None:  # FSDPMemTracker counts the state only after the step made it
            fsdp_tracker._track_optimizer_states(_FSDPRefType.OPT, optimizer)
        return fsdp_tracker
    tracker = _StepTracker(blocks=blocks, roots=roots)
    tracker.track_external(*roots, *([optimizer] if optimizer is not None else []))
    tracker.track_external(*[leaf for leaf in tree_leaves(inputs) if isinstance(leaf, torch.Tensor)])
    return tracker


@contextmanager
def traced_step(tracker: _StepTracker | _FSDPStepTracker) -> Iterator[None]:
    """The tracker counting a step; what the step raises becomes a ``StepMemoryError`` naming where
    the tracker was."""

    def where() -> str:
        return f"{tracker.current_module() or 'the model'} ({tracker.current_phase()})"

    with step_errors(where), tracker, untracked_shape_propagation(tracker):
        yield
