"""SPEC §3: every spec is frozen and validated on construction."""

from __future__ import annotations

import dataclasses
import re
import threading

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from meshbind import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec, PatternError, World


def check(**kwargs: object) -> None:
    return None


def provider(module: object, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    return ModuleShardingSpec()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"protocol": ""}, "protocol"),
        ({"protocol": 3}, "protocol"),
        ({"protocol": "p", "version": ""}, "version"),
        ({"protocol": "p", "binding_kind": "tp", "stages": {"forward": ()}, "validate": check}, "binding_kind must be one of"),
        ({"protocol": "p", "binding_kind": "cp", "validate": check}, "stages"),
        ({"protocol": "p", "binding_kind": "cp", "stages": {"forward": ()}}, "validate"),
        ({"protocol": "p", "binding_kind": "ep", "stages": {"forward": ()}, "validate": check}, "num_experts"),
        ({"protocol": "p", "stages": {"forward": "x"}}, "stages"),
        ({"protocol": "p", "stages": {"not a name": ()}}, "stages"),
        ({"protocol": "p", "stages": {"forward": ("x-y",)}}, "stages"),
        ({"protocol": "p", "validate": 3}, "validate"),
        ({"protocol": "p", "validate_materialized": "no"}, "validate_materialized"),
        ({"protocol": "p", "options": [1]}, "options"),
        ({"protocol": "p", "options": {"lock": threading.Lock()}}, "options must be deep-copyable: TypeError"),
    ],
)
def test_parallel_module_spec_rejects_each_bad_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ParallelModuleSpec(**kwargs)  # type: ignore[arg-type]


def test_stages_and_options_are_read_only_and_options_deep_copied() -> None:
    options = {"num_experts": 4, "nested": {"k": [1]}}
    stages = {"forward": ["x"]}
    spec = ParallelModuleSpec("moe", "ep", stages=stages, validate=check, options=options)
    options["nested"]["k"].append(2)  # type: ignore[index]
    options["num_experts"] = 5
    stages["forward"].append("y")
    assert spec.options["num_experts"] == 4 and spec.options["nested"] == {"k": [1]}
    assert spec.stages == {"forward": ("x",)}
    with pytest.raises(TypeError):
        spec.options["num_experts"] = 8  # type: ignore[index]
    with pytest.raises(TypeError):
        spec.stages["backward"] = ()  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.protocol = "other"  # type: ignore[misc]


def test_equal_specs_compare_and_hash_equal() -> None:
    a = ParallelModuleSpec("p", stages={"forward": ("x",)}, options={"k": [1]})
    b = ParallelModuleSpec("p", stages={"forward": ["x"]}, options={"k": [1]})
    assert a == b and hash(a) == hash(b)
    assert a != ParallelModuleSpec("p", stages={"forward": ("x",)}, options={"k": [2]})


def test_request_rejects_a_bare_string_match() -> None:
    spec = ParallelModuleSpec("p")
    with pytest.raises(ValueError, match="bare str"):
        NativeParallelBindingRequest("layers.*.mlp", spec, provider)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("match", "parallel", "sharding", "message"),
    [
        ((), ParallelModuleSpec("p"), provider, "non-empty"),
        (("a", 3), ParallelModuleSpec("p"), provider, "must be a str"),
        (("a",), "spec", provider, "parallel"),
        (("a",), ParallelModuleSpec("p"), "provider", "sharding"),
    ],
)
def test_request_rejects_each_bad_field(match: object, parallel: object, sharding: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NativeParallelBindingRequest(match, parallel, sharding)  # type: ignore[arg-type]


def test_request_rejects_a_malformed_pattern_with_its_position() -> None:
    with pytest.raises(PatternError) as caught:
        NativeParallelBindingRequest(("layers.[0-9",), ParallelModuleSpec("p"), provider)
    assert caught.value.pattern == "layers.[0-9"


def test_request_accepts_a_list_and_stores_a_tuple() -> None:
    request = NativeParallelBindingRequest(["a", "b.*"], ParallelModuleSpec("p"), provider)  # type: ignore[arg-type]
    assert request.match == ("a", "b.*")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": {"w": {"ep": "Shard(0)"}}}, r"params\['w'\]\['ep'\] must be a torch.distributed.tensor Placement"),
        ({"params": {"": {"ep": Shard(0)}}}, "parameter path"),
        ({"params": {"w": {1: Shard(0)}}}, "axis name"),
        ({"params": [("w", {})]}, "params must be a mapping"),
        ({"in_src": {"cp": 1}}, "in_src"),
        ({"out_dst": {"cp": None}}, "out_dst"),
        ({"expert_stack": 0}, "expert_stack"),
        ({"expert_stack": True}, "expert_stack"),
    ],
)
def test_sharding_spec_rejects_each_bad_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModuleShardingSpec(**kwargs)  # type: ignore[arg-type]


def test_sharding_spec_uses_torch_placements_and_is_read_only() -> None:
    params = {"w": {"ep": Shard(0), "tp": Replicate()}}
    spec = ModuleShardingSpec(params=params, out_src={"tp": Partial()}, out_dst={"tp": Partial()})
    params["w"]["dp"] = Replicate()
    assert dict(spec.params["w"]) == {"ep": Shard(0), "tp": Replicate()}
    with pytest.raises(TypeError):
        spec.params["w"]["dp"] = Replicate()  # type: ignore[index]
    assert spec.to_dict()["params"] == {"w": {"ep": "Shard(dim=0)", "tp": "Replicate()"}}


@pytest.mark.parametrize("sizes", [{"ep": 0}, {"ep": 2**63}, {"ep": True}, {"ep": 2.0}, {"": 2}, [("ep", 2)]])
def test_layout_context_rejects_bad_sizes(sizes: object) -> None:
    with pytest.raises(ValueError, match="axis"):
        LayoutContext(sizes)  # type: ignore[arg-type]


def test_layout_context_is_read_only_and_names_a_missing_axis() -> None:
    sizes = {"dp_shard": 4, "ep": 4}
    context = LayoutContext(sizes)
    sizes["cp"] = 2
    assert dict(context.axis_sizes) == {"dp_shard": 4, "ep": 4}
    assert context.size("ep") == 4
    with pytest.raises(ValueError, match="no 'cp' axis"):
        context.size("cp")


@pytest.mark.parametrize(
    ("sizes", "because"),
    [
        ({"tp": 2, "ep": 4}, "ep=4 does not divide dp_shard * cp * tp = 1 * 1 * 2 = 2"),
        ({"ep": 2}, "ep=2 does not divide dp_shard * cp * tp = 1 * 1 * 1 = 1"),
        ({"dp_shard": 3, "cp": 2, "ep": 4}, "ep=4 does not divide dp_shard * cp * tp = 3 * 2 * 1 = 6"),
        # dp (dp_replicate) replicates the experts: it lends them no ranks, as in torchtitan.
        ({"dp": 2, "ep": 2}, "dp_replicate=2 replicates the experts, it lends them no ranks"),
    ],
)
def test_a_world_the_axes_cannot_make_is_refused_offline_with_the_sizes_that_work(sizes: dict[str, int], because: str) -> None:
    # MeshContext.build refuses these too: some experts would live on no rank, or a rank would hold two shards.
    with pytest.raises(ValueError, match=re.escape(because)) as caught:
        LayoutContext(sizes)
    borrowed = sizes.get("dp_shard", 1) * sizes.get("cp", 1) * sizes.get("tp", 1)
    fitting = ", ".join(str(size) for size in range(1, borrowed + 1) if borrowed % size == 0)
    assert f"use ep = {fitting}, or a dp_shard, cp and tp whose product is a multiple of {sizes['ep']}" in str(caught.value)
    assert LayoutContext({**sizes, "dp_shard": sizes["ep"] * sizes.get("dp_shard", 1)}).size("ep") == sizes["ep"]


@pytest.mark.parametrize(
    ("sizes", "because"),
    [
        ({"sp": 2}, "'sp' is not an axis of the world"),
        ({"dp": 2, "dp_replicate": 2}, "the 'dp_replicate' axis is given twice"),
        ({"edp_shard": 2}, "'edp_shard' is not an axis of the world"),
    ],
)
def test_an_axis_the_world_does_not_have_is_refused(sizes: dict[str, int], because: str) -> None:
    with pytest.raises(ValueError, match=re.escape(because)):
        LayoutContext(sizes)


def test_the_world_derives_the_expert_axes_and_each_ranks_coordinates() -> None:
    world = LayoutContext({"dp": 2, "dp_shard": 2, "cp": 2, "tp": 2, "ep": 4}).world
    assert world == World(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4) and world.size == 16
    assert (world.edp_replicate, world.edp_shard, world.fsdp_shard) == (2, 2, 4)
    assert world.coordinates(13) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 1, "ep": 1}
    assert world.size_of("dp") == 2 and world.size_of("edp_shard") == 2


def test_required_must_be_a_bool() -> None:
    spec = ParallelModuleSpec("p")
    with pytest.raises(ValueError, match=r"NativeParallelBindingRequest\.required must be a bool, got .no."):
        NativeParallelBindingRequest(("a",), spec, lambda m, f, c: ModuleShardingSpec(), required="no")  # type: ignore[arg-type]
