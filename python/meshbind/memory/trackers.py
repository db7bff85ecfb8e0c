"""torch's memory trackers for one step: ``MemTracker``, or ``FSDPMemTracker`` under FSDP, and
where each one's peak falls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._pytree import tree_leaves

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
    """Where the step's peak falls, and the most bytes live in each place the step runs in (its
    module and phase), kept after each op; nothing counted while ``untracked``
    (``untracked_shape_propagation``)."""

    untracked = False

    def __init__(self, *args: Any, blocks: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._places: dict[Place, dict[Any, int]] = {}
        self._peak_place: Place = ("<root>", "forward", "")
        self._block_prefix = None if blocks is None else f"{blocks}." if blocks else ""
        self._last_block: dict[str, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.untracked:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]

    _mod_tracker: Any
    _in_opt: bool
    _peak_mem: dict[torch.device, int]
    _peak_mem_snap: dict[torch.device, dict[Any, int]]
    _curr_mem_snap: dict[torch.device, dict[Any, int]]
    _root_name: str

    def _update_peak_stats(self, peak_state: Any) -> None:
        before = self._peak_mem.get(TRACED_DEVICE, 0)
        super()._update_peak_stats(peak_state)  # type: ignore[misc]
        current = self._curr_mem_snap.get(TRACED_DEVICE)
        if current is None:
            return
        place = self._place()
        if self._peak_mem.get(TRACED_DEVICE, 0) > before:
            self._peak_place = place
        if place not in self._places or current["Total"] > self._places[place]["Total"]:
            self._places[place] = dict(current)

    def _place(self) -> Place:
        module, phase = self.current_module() or "<root>", self.current_phase()
        prefix = self._block_prefix
        if prefix is not None and module.startswith(prefix):
            number = module[len(prefix) :].partition(".")[0]
            if number.isdigit():
                self._last_block[phase] = prefix + number
        return module, phase, self._last_block.get(phase, "")

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
        return Peak(total, figures, module, phase, places)


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
    pass


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
    model: nn.Module, optimizer: torch.optim.Optimizer | None, inputs: Any, blocks: str | None = None
) -> _StepTracker | _FSDPStepTracker:
    """``FSDPMemTracker`` when the root is an FSDP unit (it names the all-gather and reduce-scatter
    buffers), ``MemTracker`` otherwise; the parameters, optimizer state and inputs made before the
    step are counted from its start. ``blocks`` is the FQN of the model's layer list, if any: its
    blocks tell the places of the step apart (``Place``)."""
    if isinstance(model, FSDPModule):
        fsdp_tracker = _FSDPStepTracker(model, optimizer, blocks=blocks)
        fsdp_tracker.track_inputs(inputs)
        if optimizer is not None:  # FSDPMemTracker counts the state only after the step made it
            fsdp_tracker._track_optimizer_states(_FSDPRefType.OPT, optimizer)
        return fsdp_tracker
    tracker = _StepTracker(blocks=blocks)
    tracker.track_external(model, *([optimizer] if optimizer is not None else []))
    tracker.track_external(*[leaf for leaf in tree_leaves(inputs) if isinstance(leaf, torch.Tensor)])
    return tracker
