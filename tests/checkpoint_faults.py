"""Saves on a gloo world that a rank does not survive (run on every rank by
test_checkpoint_faults.py): the victim exits at one phase of ``save_checkpoint``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshbind.checkpoints import save as saving
from meshbind.checkpoints import save_checkpoint

PHASES = {
    # phase: (the function the victim dies in, the victim's rank)
    "writing shards": ("save", 1),
    "after its shards, before reporting them": ("file_entry", 1),
    "after the manifest, before publishing": ("_publish", 0),
}


def model_of(version: int, sharded: bool) -> nn.Module:
    """A Linear whose weights depend on ``version`` only; ``sharded``: its weight split by row over the world."""
    torch.manual_seed(version)
    model = nn.Linear(8, 8).double()
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    return model


@torch.no_grad()
def loss_of(model: nn.Module) -> float:
    weight = model.weight.full_tensor() if isinstance(model.weight, DTensor) else model.weight
    return float((weight @ torch.arange(8.0, dtype=torch.float64)).square().sum() + model.bias.sum())


def save_then_die(directory: str, version: int, phase: str | None) -> float:
    """Save ``version`` into ``directory``; with ``phase``, the victim rank exits there."""
    model = model_of(version, sharded=True)
    if phase is not None:
        function, victim = PHASES[phase]
        if dist.get_rank() == victim:
            setattr(saving, function, lambda *args, **kwargs: os._exit(3))
    save_checkpoint(model, directory)
    return loss_of(model)
