"""One training step of one rank on fake tensors, the plan applied as a training job applies it
over torch's fake process group: what step memory and step collectives both watch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from meshbind.errors import StepMemoryError
from meshbind.memory.attention import CudaAttention, real_step_masks
from meshbind.memory.fake_world import fake_world, without_torch_advice
from meshbind.memory.fsdp_chunks import chunks_for_traced_rank
from meshbind.memory.result import StepSettings
from meshbind.memory.step import StepInputs, apply_plan, default_inputs, make_optimizer, make_optimizer_state, training_step
from meshbind.mesh import MeshContext
from meshbind.names import Device
from meshbind.resolution.plan import ParallelPlan
from meshbind.routing import assuming


@contextlib.contextmanager
def step_errors(where: Callable[[], str]) -> Iterator[None]:
    """What a traced step raises, as a ``StepMemoryError`` naming where the step was (``where()``)."""
    try:
        yield
    except StepMemoryError:
        raise
    except Exception as error:
        first_line = str(error).splitlines()[0] if str(error) else ""
        raise StepMemoryError(
            f"one training step cannot be traced with fake tensors: {where()} raised {type(error).__name__}: {first_line}"
        ) from error


Watch = Callable[[nn.Module, Any, tuple[tuple[Any, ...], dict[str, Any]], MeshContext], AbstractContextManager[Any]]
"""``watch(model, optimizer, (args, kwargs), mesh_context)``: what is entered around the step."""


def run_fake_step(
    model: nn.Module, plan: ParallelPlan, rank: int, settings: StepSettings, inputs: StepInputs | None, watch: Watch
) -> None:
    """``model`` (on ``meta``) planned as ``rank`` of the plan's world, then one step (forward,
    backward, optimizer step) under ``watch``; the optimizer's state is made before it."""
    with without_torch_advice(), chunks_for_traced_rank(), fake_world(rank, plan.context.world) as mesh_context:
        on_device = CudaAttention if settings.device is Device.CUDA else contextlib.nullcontext
        apply_plan(model, plan, mesh_context, settings.activation_checkpointing, on_device)
        step_inputs = inputs or default_inputs(model)
        with FakeTensorMode(allow_non_fake_inputs=True), assuming(settings.routing), on_device(), real_step_masks():
            model.to_empty(device="cpu")
            optimizer = make_optimizer(model, settings.optimizer, settings.device, on_local_shards=True)
            make_optimizer_state(optimizer)
            args, kwargs = step_inputs(settings.batch, settings.seq_len)
            with watch(model, optimizer, (args, kwargs), mesh_context):
                training_step(model, optimizer, args, kwargs)


def watched_by(*watches: Callable[..., AbstractContextManager[Any]]) -> Callable[..., AbstractContextManager[Any]]:
    """One watch entering each of ``watches`` around the same step, in order (a ``Watch`` or a
    pipelined one): one traced step answers each of them."""

    @contextlib.contextmanager
    def watch(*args: Any) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for each in watches:
                stack.enter_context(each(*args))
            yield

    return watch
