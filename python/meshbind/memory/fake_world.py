"""Torch's fake process group in the place of the default one, and the meshes of one traced rank
over it: a trace runs the plan's collectives without running them."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from meshbind.mesh import MeshContext
from meshbind.world import DENSE_AXES, EXPERT_AXES, PIPELINE_AXIS, World


@contextmanager
def fake_world(rank: int, world: World) -> Iterator[MeshContext]:
    """The default group replaced by torch's fake one for ``rank``, and both meshes over it (the
    expert mesh even at ``ep`` 1: expert modules bind over one-rank groups there); under a
    pipeline, the meshes of the rank's stage and its ``pp`` mesh, laid as ``MeshContext.build``
    lays them (``pp`` outermost)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # DTensor caches each op's sharding by its meshes, and a mesh is equal to another over the same
    # ranks whatever its groups: a cached answer would carry one world's mesh (and its groups) into
    # another, a fake world's into a real one. Each fake world starts and ends with none cached.
    _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world.size)
    try:
        stage = rank // world.stage_size
        pp_mesh = None
        if world.pp > 1:
            across = torch.arange(world.size).view(world.pp, world.stage_size)[:, rank % world.stage_size]
            pp_mesh = _rank_mesh(rank, across, (PIPELINE_AXIS,))
        dense = torch.arange(world.size).view(world.pp, *world.dense_shape)[stage]
        expert = torch.arange(world.size).view(world.pp, *world.expert_shape)[stage]
        yield MeshContext(_rank_mesh(rank, dense, DENSE_AXES), _rank_mesh(rank, expert, EXPERT_AXES), pp_mesh)
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]


def _rank_mesh(rank: int, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """A device mesh over ``ranks`` (holding ``rank``) on the fake group, with only ``rank``'s own
    group along each dim: ``init_device_mesh`` would make every group of every dim, a million at a
    million ranks."""
    shape = tuple(ranks.shape)
    coordinate = [int(index[0]) for index in torch.nonzero(ranks == rank, as_tuple=True)]
    groups: list[dist.ProcessGroup] = []
    for dim in range(len(shape)):
        along = ranks[tuple(slice(None) if index == dim else coordinate[index] for index in range(len(shape)))]
        group = dist.new_group(along.tolist(), use_local_synchronization=True)
        assert isinstance(group, dist.ProcessGroup)  # the rank is in every group made here
        groups.append(group)
    return DeviceMesh.from_group(groups, "cpu", mesh=ranks, mesh_dim_names=names)


@contextmanager
def without_torch_advice() -> Iterator[None]:
    """torch.distributed's warnings are for the user's own run, which will give them again."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed")
        yield
