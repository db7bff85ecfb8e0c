"""Where a module's backward ends, as the memory trackers learn it: torch's module tracker waits for
the gradients of the module's inputs, here without the reference cycle torch's own hook closes
around the autograd graph (which would keep what a pipeline stage lets go of until a garbage
collection)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves


def module_pre_forward(mod_tracker: Any) -> Callable[[nn.Module, Any], None]:
    """torch's module tracker's pre-forward hook (``ModTracker._fw_pre_hook``) but for how it waits
    for the gradients of a module's inputs, which ends the module's backward.

    torch waits with ``register_multi_grad_hook``, whose hook holds the inputs' autograd nodes and
    is held by them: a reference cycle, so a graph a pipeline stage lets go of (an output released
    once sent, what a split backward kept for the weights' gradients) is freed by the next garbage
    collection, not where a real step frees it. Here the hook holds the nodes only until it has
    run. A leaf input is not waited on: ``autograd.grad`` refuses a hook on a leaf (a pipeline
    stage's received input, under a schedule that splits its backward); a module with no other
    input requiring a gradient ends its backward at the backward's end, as torch ends one with none."""

    def pre_forward(module: nn.Module, inputs: Any) -> None:
        if torch._dynamo.eval_frame._is_in_optimized_module():
            return
        name = mod_tracker._get_mod_name(module)
        module_ref = weakref.ref(module)
        mod_tracker._get_append_fn(module_ref, name, False)()
        if mod_tracker._user_pre_fw_hook is not None:
            mod_tracker._user_pre_fw_hook(module, inputs)
        if mod_tracker.is_bw:
            return
        backward_done = mod_tracker._get_pop_fn(module_ref, name, True)
        waited = [leaf for leaf in tree_leaves(inputs) if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]
        if waited:
            _when_gradients_computed(waited, backward_done)
        else:
            mod_tracker._post_bw_callbacks_to_enqueue.append(backward_done)

    return pre_forward


def _when_gradients_computed(tensors: list[torch.Tensor], done: Callable[[], Any]) -> None:
    """``done()`` once a backward has computed the gradients of all of ``tensors`` that it computes
    (``register_multi_grad_hook``'s "all" mode), holding their autograd nodes only until then.
    torch's engine does not list a backward's root among the nodes it will run (a stage's output
    handed on unchanged, the root of the stage's backward): a tensor whose gradient arrives counts."""
    nodes: list[Any] | None = [tensor.grad_fn for tensor in tensors]
    waiting: dict[int, set[int]] = {}  # by autograd's graph task: the tensors whose gradients are still to come

    def computed(index: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            nonlocal nodes
            if nodes is None:
                return
            task = torch._C._current_graph_task_id()
            if task not in waiting:
                waiting[task] = {place for place, node in enumerate(nodes) if torch._C._will_engine_execute_node(node)}
            left = waiting[task]
            left.discard(index)
            if not left:
                nodes = None
                del waiting[task]
                done()

        return hook

    for index, tensor in enumerate(tensors):
        tensor.register_hook(computed(index))  # type: ignore[no-untyped-call]
