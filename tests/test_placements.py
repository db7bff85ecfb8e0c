"""Placement arithmetic (meshbind.placements): negative shard dims counted from the end everywhere,
local shapes, and the Rust balanced-layout and rank checks agreeing with it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from meshbind import (
    LayoutContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    PlanError,
    plan_report,
    resolve_plan,
)
from meshbind.placements import local_shape, split_dim

SPEC = ParallelModuleSpec("plain")


def weight_plan(model: nn.Module, placement: object, tp: int) -> object:
    layout = ModuleShardingSpec(params={"weight": {"tp": placement}})  # type: ignore[dict-item]
    request = NativeParallelBindingRequest(("proj",), SPEC, lambda module, fqn, context: layout)
    return resolve_plan(model, [request], LayoutContext({"tp": tp}))


@pytest.mark.parametrize("placement", [Shard(1), Shard(-1)])
def test_a_negative_shard_dim_is_reported_like_the_positive_one(placement: Shard) -> None:
    # nn.Linear(8, 16): weight [16, 8]; at tp=4 both split the 8 columns into 2 per rank.
    model = nn.Module()
    model.proj = nn.Linear(8, 16, bias=False, device="meta")
    report = plan_report(model, weight_plan(model, placement, 4), optimizer="none")  # type: ignore[arg-type]
    (row,) = report.params
    assert (row.local_shape, row.bytes_per_rank) == ((16, 2), 16 * 2 * 4)


def test_split_dim_counts_from_the_end_and_refuses_a_missing_dimension() -> None:
    assert [split_dim(Shard(d), 3) for d in (-3, -1, 0, 2)] == [0, 2, 0, 2]
    assert split_dim(Shard(3), 3) is None and split_dim(Shard(-4), 3) is None
    assert split_dim(Replicate(), 3) is None and split_dim(None, 2) is None
    assert local_shape((16, 8), {"tp": Shard(-1), "dp": Shard(0)}, {"tp": 4, "dp": 2}) == (8, 2)
    assert local_shape((16, 8), {"ep": Shard(0)}, {}) == (16, 8)  # an axis the sizes lack counts 1


@given(
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    dim=st.integers(-4, 3),
    tp=st.integers(1, 4),
)
def test_the_rust_checks_agree_with_the_arithmetic(shape: list[int], dim: int, tp: int) -> None:
    """Resolution (the Rust rank and balanced-layout checks) accepts exactly what split_dim and
    local_shape call a dimension of the tensor that tp divides; a torch tensor sharded alike agrees."""
    model = nn.Module()
    model.proj = nn.Module()
    model.proj.weight = nn.Parameter(torch.empty(shape, device="meta"))
    split = split_dim(Shard(dim), len(shape))
    try:
        plan = weight_plan(model, Shard(dim), tp)
    except PlanError as error:
        (problem,) = error.problems
        assert split is None or shape[split] % tp, problem.message
        return
    assert split is not None and shape[split] % tp == 0
    expected = list(shape)
    expected[split] = torch.empty(shape).tensor_split(tp, dim=dim)[0].shape[split]
    assert local_shape(shape, {"tp": Shard(dim)}, {"tp": tp}) == tuple(expected)
    assert plan_report(model, plan).params[0].local_shape == tuple(expected)  # type: ignore[arg-type]
