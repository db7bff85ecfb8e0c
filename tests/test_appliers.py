"""The applier of each plan source (``meshbind.appliers``): chosen by the protocol the source's plan
resolves to; a plan mixing two sources is refused before anything is applied."""

from __future__ import annotations

import pytest
from torch import nn

from meshbind import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec, resolve_plan
from meshbind.appliers import APPLIERS, apply_parallelism
from meshbind.interop import HF_PROTOCOL, torch_plans


def _request(pattern: str, protocol: str) -> NativeParallelBindingRequest:
    return NativeParallelBindingRequest(
        (pattern,), ParallelModuleSpec(protocol), lambda module, fqn, context: ModuleShardingSpec()
    )


def test_each_source_has_its_applier_and_a_plan_of_two_sources_is_refused() -> None:
    assert set(APPLIERS) == {HF_PROTOCOL, torch_plans.PROTOCOL}
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    plan = resolve_plan(model, [_request("0", HF_PROTOCOL), _request("1", torch_plans.PROTOCOL)], LayoutContext({}))
    weight = model[0].weight
    with pytest.raises(ValueError, match=r"mixes modules of the protocols \['hf_parallel_style', 'torch_parallel_style'\]"):
        apply_parallelism(model, plan, None)  # type: ignore[arg-type]
    assert model[0].weight is weight
