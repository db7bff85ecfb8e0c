"""SPEC §4: resolve_plan collects every problem of a whole model into one PlanError."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

import meshbind
from meshbind import (
    LayoutContext,
    ModuleShardingSpec,
    NativeParallelBindingRequest,
    ParallelModuleSpec,
    PlanError,
    get_family_build_info,
    resolve_plan,
)

from pattern_strategies import names, patterns

HIDDEN, EXPERTS = 8, 4
CONTEXT = LayoutContext({"dp": 1, "cp": 2, "ep": 2})


def accept(**kwargs: Any) -> None:
    return None


class Attention(nn.Module):
    """A family module: its class owns the cp protocol."""

    parallel_spec = ParallelModuleSpec("cp_attention", "cp", stages={"forward": ("x",)}, validate=accept)

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.qkv(x)

    def bind_parallel(self, binding: object) -> None:
        self.binding = binding

    def parallel_sharding(self, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return ModuleShardingSpec(params={"qkv.weight": {"cp": Replicate()}})


class Experts(nn.Module):
    def __init__(self, num_experts: int = EXPERTS) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, HIDDEN, 16))

    def route(self, tokens: torch.Tensor, *, expert_ids: torch.Tensor) -> torch.Tensor:
        return tokens

    def bind_parallel(self, binding: object) -> None:
        self.binding = binding


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.mlp = Experts()


class Model(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, 16, bias=False)


EP_SPEC = ParallelModuleSpec(
    "moe", "ep", stages={"route": ("tokens", "expert_ids")}, validate=accept, options={"num_experts": EXPERTS}
)
LINEAR_SPEC = ParallelModuleSpec("linear", stages={"forward": ("input",)})


def experts_sharding(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    return ModuleShardingSpec(params={"w1": {"ep": Shard(0)}})


def linear_sharding(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
    return ModuleShardingSpec(params={"weight": {"dp": Replicate()}})


EXPERTS_REQUEST = NativeParallelBindingRequest(("layers.*.mlp",), EP_SPEC, experts_sharding)
HEAD_REQUEST = NativeParallelBindingRequest(("head",), LINEAR_SPEC, linear_sharding)


def problems_of(
    model: nn.Module | list[str], requests: list[NativeParallelBindingRequest], **kwargs: Any
) -> list[meshbind.PlanProblem]:
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, requests, kwargs.pop("context", CONTEXT), **kwargs)
    return list(caught.value.problems)


def test_a_valid_plan_lists_requests_and_family_members_in_tree_order() -> None:
    plan = resolve_plan(Model(), [HEAD_REQUEST, EXPERTS_REQUEST], CONTEXT)
    assert list(plan.parallel_modules) == ["layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp", "head"]
    assert plan.parallel_modules["layers.0.attn"] is Attention.parallel_spec
    assert plan.sources["layers.1.mlp"] == "requests[1]" and plan.sources["layers.1.attn"] == "family Attention"
    assert plan.sharding["head"].params["weight"] == {"dp": Replicate()}
    assert plan.context is CONTEXT
    with pytest.raises(TypeError):
        plan.parallel_modules["x"] = LINEAR_SPEC  # type: ignore[index]
    table = plan.explain()
    assert "layers.0.mlp" in table and "moe v1" in table and "5 planned modules" in table
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["context"] == {"dp": 1, "cp": 2, "ep": 2}
    assert data["modules"][1] == {
        "fqn": "layers.0.mlp",
        "protocol": "moe",
        "version": "1",
        "binding_kind": "ep",
        "source": "requests[1]",
        "sharding": {"params": {"w1": {"ep": "Shard(dim=0)"}}, "in_src": {}, "in_dst": {}, "out_src": {}, "out_dst": None},
    }


def test_resolution_works_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = Model()
    assert len(resolve_plan(model, [EXPERTS_REQUEST], CONTEXT).parallel_modules) == 4


def test_family_build_info_records_the_layout_unapplied() -> None:
    model = Model()
    attention = model.layers[0].attn
    assert get_family_build_info(attention).layout is None
    resolve_plan(model, [], CONTEXT)
    info = get_family_build_info(attention)
    assert info.fqn == "layers.0.attn" and info.layout is not None
    assert info.layout.spec is Attention.parallel_spec and not info.layout.applied
    assert info.layout.sharding.params["qkv.weight"] == {"cp": Replicate()}
    with pytest.raises(ValueError, match="not a family module"):
        get_family_build_info(model.head)


def test_a_failed_resolution_records_nothing() -> None:
    model = Model()
    problems_of(model, [NativeParallelBindingRequest(("nothing",), LINEAR_SPEC, linear_sharding)])
    assert get_family_build_info(model.layers[0].attn).layout is None


class NotAFamily(nn.Module):
    """Its class's ``parallel_spec`` is no ParallelModuleSpec: a problem, not a crash."""

    parallel_spec = "cp_attention"

    def parallel_sharding(self, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return ModuleShardingSpec()


def test_a_family_class_whose_parallel_spec_is_no_spec_is_a_binding_problem() -> None:
    model = Model()
    model.odd = NotAFamily()
    [problem] = problems_of(model, [EXPERTS_REQUEST])
    assert (problem.code, problem.fqn, problem.request) == ("binding", None, "family NotAFamily")
    assert "NotAFamily.parallel_spec must be a ParallelModuleSpec, got str" in problem.message


def test_one_sharding_object_is_checked_against_each_modules_own_expert_count() -> None:
    shared = ModuleShardingSpec(params={"w1": {"ep": Shard(0)}})
    model = nn.Module()
    model.small, model.large = Experts(4), Experts(8)
    requests = [
        NativeParallelBindingRequest(
            (name,), dataclasses.replace(EP_SPEC, options={"num_experts": count}), lambda m, f, c: shared
        )
        for name, count in (("small", 4), ("large", 8))
    ]
    assert list(resolve_plan(model, requests, CONTEXT).parallel_modules) == ["small", "large"]


def test_resolution_leaves_modules_that_are_no_family_members_untouched() -> None:
    model = Model()
    before = {name: dict(vars(module)) for name, module in model.named_modules()}
    resolve_plan(model, [EXPERTS_REQUEST, HEAD_REQUEST], CONTEXT)
    changed = [name for name, module in model.named_modules() if vars(module) != before[name]]
    assert changed == ["layers.0.attn", "layers.1.attn"]  # the family members' build info


def test_a_typo_is_unmatched_with_suggestions(walk: str) -> None:
    """The pruned walk records only matches: the suggestions come from every FQN all the same."""
    [problem] = problems_of(Model(), [NativeParallelBindingRequest(("layers.*.mpl",), EP_SPEC, experts_sharding)])
    assert problem.code == "unmatched" and problem.fqn is None and problem.request == "requests[0]"
    assert "'layers.*.mpl'" in problem.message and "did you mean 'layers.0.mlp', 'layers.1.mlp'" in problem.message
    # A typo in the first segment, where the pruned walk goes no further than the root's children.
    [problem] = problems_of(Model(), [NativeParallelBindingRequest(("lyers.*.mlp",), EP_SPEC, experts_sharding)])
    assert "did you mean 'layers.0.mlp', 'layers.1.mlp'" in problem.message
    # A pattern far from every FQN gets no suggestion, not the nearest nonsense.
    [problem] = problems_of(Model(), [NativeParallelBindingRequest(("zzz",), EP_SPEC, experts_sharding)])
    assert problem.message == "pattern 'zzz' does not select any module"


def test_a_conflict_names_both_requests() -> None:
    other = ParallelModuleSpec("moe_v2", "ep", stages={"route": ("tokens",)}, validate=accept, options={"num_experts": EXPERTS})
    second = NativeParallelBindingRequest(("layers.1.mlp",), other, experts_sharding)
    problems = problems_of(Model(), [EXPERTS_REQUEST, second])
    conflicts = [p for p in problems if p.code == "conflict"]
    assert [p.fqn for p in conflicts] == ["layers.1.mlp"]
    assert "requests[0] (moe v1 (ep))" in conflicts[0].message and "requests[1] (moe_v2 v1 (ep))" in conflicts[0].message


def test_two_requests_with_equal_specs_do_not_conflict() -> None:
    twin = NativeParallelBindingRequest(("layers.{0,1}.mlp",), EP_SPEC, experts_sharding)
    assert len(resolve_plan(Model(), [EXPERTS_REQUEST, twin], CONTEXT).parallel_modules) == 4


def test_two_requests_with_equal_specs_and_different_layouts_conflict() -> None:
    """Which layout binds the module would otherwise depend on the order of the requests."""
    replicated = ModuleShardingSpec(params={"w1": {"ep": Replicate()}, "w2": {"ep": Shard(0)}})
    twin = NativeParallelBindingRequest(("layers.1.mlp",), EP_SPEC, lambda module, fqn, context: replicated)
    problems = problems_of(Model(), [EXPERTS_REQUEST, twin])
    assert [(p.code, p.fqn, p.request) for p in problems] == [("conflict", "layers.1.mlp", "requests[0], requests[1]")]
    assert problems[0].message == (
        "selected by requests[0] and requests[1] with equal specs (moe v1 (ep)) but different layouts: "
        "params {w1: {ep: S(0)}} against {w1: {ep: R}, w2: {ep: S(0)}}"
    )
    # Each other request is compared with the first: an agreeing one is no conflict.
    agreeing = NativeParallelBindingRequest(("layers.*.mlp",), EP_SPEC, experts_sharding)
    problems = problems_of(Model(), [EXPERTS_REQUEST, agreeing, twin])
    assert [(p.code, p.fqn, p.request) for p in problems] == [("conflict", "layers.1.mlp", "requests[0], requests[2]")]
    # The second provider's own failures are reported as its layout problems.
    broken = NativeParallelBindingRequest(("layers.1.mlp",), EP_SPEC, lambda module, fqn, context: None)
    [problem] = problems_of(Model(), [EXPERTS_REQUEST, broken])
    assert (problem.code, problem.request) == ("layout", "requests[1]") and "returned NoneType" in problem.message


MIXIN_FAMILY_SCRIPT = """
from torch import nn
from meshbind import LayoutContext, ModuleShardingSpec, NativeParallelBindingRequest, ParallelModuleSpec, resolve_plan
from meshbind.family import family_classes_declared

assert not family_classes_declared()  # so resolution may prune: the case under test


class OwnsProtocol:  # a mixin, no module
    parallel_spec = ParallelModuleSpec("mixed", stages={"forward": ("x",)})

    def parallel_sharding(self, fqn, context):
        return ModuleShardingSpec()


class Mixed(OwnsProtocol, nn.Module):
    def forward(self, x):
        return x


model = nn.Module()
model.head = nn.Linear(2, 2)
model.block = nn.Module()
model.block.mixed = Mixed()
linear = ParallelModuleSpec("linear", stages={"forward": ("input",)})
request = NativeParallelBindingRequest(("head",), linear, lambda module, fqn, context: ModuleShardingSpec())
print(list(resolve_plan(model, [request], LayoutContext({"dp": 1})).parallel_modules))
"""


def test_a_family_member_no_request_reaches_joins_when_its_spec_comes_from_a_mixin() -> None:
    # A fresh interpreter: here the test modules' family classes exist, so no walk is pruned.
    result = subprocess.run([sys.executable, "-c", MIXIN_FAMILY_SCRIPT], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "['head', 'block.mixed']"


FAMILY_REGISTRATION_SCRIPT = """
import gc
from torch import nn
from meshbind import ParallelModuleSpec
from meshbind.family import family_classes_declared

class Plain(nn.Module):
    spec = ParallelModuleSpec("not_a_family")  # another name: no declaration

print(family_classes_declared())

class Member(nn.Module):
    parallel_spec = ParallelModuleSpec("member")

print(family_classes_declared())
del Member
gc.collect()
print(family_classes_declared())
"""


def test_a_family_class_is_known_by_its_declaration_while_it_lives() -> None:
    result = subprocess.run(
        [sys.executable, "-c", FAMILY_REGISTRATION_SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "True", "False"]


def test_a_request_giving_a_family_member_another_spec_conflicts() -> None:
    request = NativeParallelBindingRequest(("layers.0.attn",), LINEAR_SPEC, linear_sharding)
    [problem] = problems_of(Model(), [request])
    assert problem.code == "conflict" and problem.fqn == "layers.0.attn"
    assert "requests[0]" in problem.message and "Attention owns cp_attention" in problem.message


def test_a_request_with_the_family_spec_is_accepted() -> None:
    request = NativeParallelBindingRequest(("layers.0.attn",), Attention.parallel_spec, lambda m, f, c: ModuleShardingSpec())
    plan = resolve_plan(Model(), [request], CONTEXT)
    assert plan.sources["layers.0.attn"] == "requests[0]" and plan.sources["layers.1.attn"] == "family Attention"


def test_a_bound_module_inside_another_of_the_same_kind_is_nested() -> None:
    outer_spec = ParallelModuleSpec("block_cp", "cp", stages={"forward": ()}, validate=accept)

    class BoundBlock(Block):
        def forward(self) -> None:
            return None

        def bind_parallel(self, binding: object) -> None:
            return None

    model = Model()
    model.layers[0] = BoundBlock()
    request = NativeParallelBindingRequest(("layers.0",), outer_spec, lambda m, f, c: ModuleShardingSpec())
    problems = problems_of(model, [request, EXPERTS_REQUEST])
    assert [(p.code, p.fqn) for p in problems] == [("nested", "layers.0.attn")]
    assert "inside the 'cp' module 'layers.0'" in problems[0].message


@pytest.fixture(params=["pruned", "full"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Resolution walks the whole tree when a family class is loaded (here one is), else it prunes."""
    monkeypatch.setattr(meshbind.resolution.selection, "family_classes_declared", lambda: request.param == "full")
    return str(request.param)


def test_a_shared_module_is_keyed_by_its_first_fqn_where_the_walk_would_prune(walk: str) -> None:
    model = nn.Module()
    model.block = nn.Module()
    model.block.shared = nn.Linear(2, 2)
    model.layer = nn.Module()
    model.layer.shared = model.block.shared  # an alias: named_modules() lists only block.shared
    request = NativeParallelBindingRequest(("layer.shared",), LINEAR_SPEC, linear_sharding)
    assert list(resolve_plan(model, [request], CONTEXT).parallel_modules) == ["block.shared"]


def test_a_bound_module_inside_another_through_an_alias_is_nested(walk: str) -> None:
    model = nn.Module()
    model.x = Experts()
    model.y = Experts()
    model.y.inner = model.x  # x is keyed by 'x', and also sits inside y
    problems = problems_of(model, [NativeParallelBindingRequest(("x", "y"), EP_SPEC, experts_sharding)])
    assert [(p.code, p.fqn) for p in problems] == [("nested", "x")]
    assert "a 'ep' module inside the 'ep' module 'y'" in problems[0].message


def test_a_sibling_whose_name_extends_another_is_not_nested(walk: str) -> None:
    model = nn.Module()
    model.x = Experts()
    model.xy = Experts()  # 'xy' starts with 'x', yet it is no module below it
    plan = resolve_plan(model, [NativeParallelBindingRequest(("x", "xy"), EP_SPEC, experts_sharding)], CONTEXT)
    assert list(plan.parallel_modules) == ["x", "xy"]


def test_none_kind_modules_never_nest() -> None:
    outer = NativeParallelBindingRequest(("layers.0",), ParallelModuleSpec("block"), lambda m, f, c: ModuleShardingSpec())
    inner = NativeParallelBindingRequest(("layers.0.norm",), ParallelModuleSpec("norm"), lambda m, f, c: ModuleShardingSpec())
    assert "layers.0.norm" in resolve_plan(Model(), [outer, inner], CONTEXT).parallel_modules


def test_provider_failures_become_layout_problems() -> None:
    def raises(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        raise KeyError("hidden")

    def wrong_type(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return {"w1": Shard(0)}  # type: ignore[return-value]

    def missing_parameter(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return ModuleShardingSpec(params={"weight": {"dp": Replicate()}, "w9": {"dp": Replicate()}})

    def returns_nothing(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return None  # type: ignore[return-value]

    requests = [
        NativeParallelBindingRequest(("layers.0.mlp",), EP_SPEC, raises),
        NativeParallelBindingRequest(("layers.1.mlp",), EP_SPEC, wrong_type),
        NativeParallelBindingRequest(("head",), LINEAR_SPEC, missing_parameter),
        NativeParallelBindingRequest(("layers.0.norm",), LINEAR_SPEC, returns_nothing),
    ]
    problems = problems_of(Model(), requests)
    assert [(p.code, p.fqn) for p in problems] == [
        ("layout", "head"),
        ("layout", "layers.0.mlp"),
        ("layout", "layers.0.norm"),
        ("layout", "layers.1.mlp"),
    ]
    assert "params['w9'] names a parameter the module (Linear) lacks" in problems[0].message
    assert "raised KeyError: 'hidden'" in problems[1].message
    assert "returned NoneType, not a ModuleShardingSpec" in problems[2].message
    assert "returned dict, not a ModuleShardingSpec" in problems[3].message


def test_unknown_axes_and_shards_beyond_rank_are_layout_problems() -> None:
    def sharding(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return ModuleShardingSpec(params={"weight": {"tp": Replicate(), "dp": Shard(2)}})

    problems = problems_of(Model(), [NativeParallelBindingRequest(("head",), LINEAR_SPEC, sharding)])
    messages = sorted(p.message for p in problems)
    assert all(p.code == "layout" and p.fqn == "head" for p in problems)
    assert "Shard(2) on axis 'dp', beyond the parameter's rank 2" in messages[0]
    assert "axis 'tp', which the layout context lacks (axes: cp, dp, ep)" in messages[1]


def test_a_partial_parameter_and_an_uneven_shard_are_layout_problems() -> None:
    """SPEC §8: a parameter is never a pending sum, and each dimension it is Shard on divides by
    the product of the sizes of the axes sharding it."""

    def sharding(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        return ModuleShardingSpec(
            params={"w1": {"ep": Shard(0)}, "w2": {"ep": Shard(0), "tp": Shard(-1)}, "router": {"tp": Partial()}}
        )

    model = nn.Module()
    model.mlp = Experts(num_experts=4)
    model.mlp.w2 = nn.Parameter(torch.empty(4, 6, 5, device="meta"))
    model.mlp.router = nn.Parameter(torch.empty(4, 8, device="meta"))
    request = NativeParallelBindingRequest(("mlp",), EP_SPEC, sharding)
    problems = problems_of(model, [request], context=LayoutContext({"ep": 2, "tp": 2}))
    messages = sorted(p.message for p in problems)
    assert [(p.code, p.fqn) for p in problems] == [("layout", "mlp")] * 2
    assert messages[0].startswith("params['router'] is Partial on axis 'tp'")
    assert messages[1].startswith("params['w2'] dimension 2 of size 5 is not divisible by 2, the product of the sizes")
    assert "('tp'=2)" in messages[1]
    assert problems_of(model, [request], context=LayoutContext({"cp": 2, "ep": 2, "tp": 1}))[0].message.startswith(
        "params['router'] is Partial"
    )


def test_every_problem_of_the_model_comes_back_at_once_sorted_by_fqn() -> None:
    def bad_head(module: nn.Module | None, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
        raise RuntimeError("no layout for heads")

    requests = [
        NativeParallelBindingRequest(("head",), LINEAR_SPEC, bad_head),
        NativeParallelBindingRequest(("layers.*.mlp",), EP_SPEC, experts_sharding),
        NativeParallelBindingRequest(("embed_tokens",), LINEAR_SPEC, linear_sharding),
    ]
    with pytest.raises(PlanError) as caught:
        resolve_plan(Model(), requests, LayoutContext({"cp": 6, "ep": 3}))
    codes = [(p.code, p.fqn) for p in caught.value.problems]
    # ep=3 splits neither the 4 experts (rule 5) nor dimension 0 of w1 (balanced layouts, SPEC §8).
    assert codes == [
        ("unmatched", None),
        ("layout", "head"),
        ("expert", "layers.0.mlp"),
        ("layout", "layers.0.mlp"),
        ("expert", "layers.1.mlp"),
        ("layout", "layers.1.mlp"),
    ]
    text = str(caught.value)
    assert text.startswith("the plan has 6 problems:")
    # The two layers' problems read as one line each: they differ only in the layer index.
    assert text.index("'head'") < text.index("expert    2 modules 'layers.<0-1>.mlp': num_experts 4 is not divisible")
    assert "layout    2 modules 'layers.<0-1>.mlp': params['w1'] dimension 0 of size 4" in text
    assert isinstance(caught.value, ValueError)


def test_per_module_checks_run_for_every_planned_module() -> None:
    class NoStage(nn.Module):
        parallel_spec = ParallelModuleSpec("odd", stages={"forward": ("x",)})

        def parallel_sharding(self, fqn: str, context: LayoutContext) -> ModuleShardingSpec:
            return ModuleShardingSpec()

    model = Model()
    model.layers[1].norm = NoStage()
    problems = problems_of(model, [])
    assert [(p.code, p.fqn) for p in problems] == [("stage", "layers.1.norm")]
    assert problems[0].request is not None and problems[0].request.endswith("NoStage")


def test_validators_failures_are_collected() -> None:
    def refuse(*, module: nn.Module, **kwargs: Any) -> None:
        if module.w1.shape[0] == EXPERTS:
            raise ValueError("too few experts")

    spec = ParallelModuleSpec("moe", "ep", stages={"route": ("tokens",)}, validate=refuse, options={"num_experts": EXPERTS})
    problems = problems_of(Model(), [NativeParallelBindingRequest(("layers.*.mlp",), spec, experts_sharding)])
    assert [(p.code, p.fqn) for p in problems] == [("validator", "layers.0.mlp"), ("validator", "layers.1.mlp")]


def test_class_checks_run_once_per_class_and_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    classes = [type(f"Leaf{i}", (nn.Module,), {"forward": lambda self, input: input}) for i in range(5)]
    model = nn.Module()
    model.leaves = nn.ModuleList(classes[i % 5]() for i in range(2000))
    calls: list[type] = []
    real_class_failure = meshbind.validation.rules.class_failure

    def counting_class_failure(cls: type, spec: ParallelModuleSpec) -> Any:
        calls.append(cls)
        return real_class_failure(cls, spec)

    monkeypatch.setattr(meshbind.validation.rules, "class_failure", counting_class_failure)
    request = NativeParallelBindingRequest(("leaves.*",), LINEAR_SPEC, lambda m, f, c: ModuleShardingSpec())
    assert len(resolve_plan(model, [request], CONTEXT).parallel_modules) == 2000
    assert sorted(cls.__name__ for cls in calls) == [cls.__name__ for cls in classes]


def test_modules_sharing_one_sharding_are_each_checked_against_their_own_parameters() -> None:
    shared = ModuleShardingSpec(params={"w1": {"ep": Shard(0)}})
    model = Model(3)
    model.layers[1].mlp = Experts(num_experts=6)
    del model.layers[2].mlp._parameters["w1"]
    problems = problems_of(model, [NativeParallelBindingRequest(("layers.*.mlp",), EP_SPEC, lambda m, f, c: shared)])
    assert [(p.code, p.fqn) for p in problems] == [("expert", "layers.1.mlp"), ("layout", "layers.2.mlp")]
    assert "shape[0] is 6, not num_experts 4" in problems[0].message
    assert "names a parameter the module (Experts) lacks" in problems[1].message


def test_a_parameter_the_module_lacks_gets_the_nearest_parameters() -> None:
    """Among the module's own parameters and those of the submodule the path's prefix names."""
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2, bias=False))

    def placing(*paths: str) -> Callable[..., ModuleShardingSpec]:
        return lambda module, fqn, context: ModuleShardingSpec(params={path: {"dp": Replicate()} for path in paths})

    requests = [
        NativeParallelBindingRequest(("0",), LINEAR_SPEC, placing("0.wieght", "bais")),
        NativeParallelBindingRequest(("0.0",), LINEAR_SPEC, placing("weigth")),
        NativeParallelBindingRequest(("1",), LINEAR_SPEC, placing("bais")),  # its bias is None: no parameter
    ]
    messages = [problem.message for problem in problems_of(model, requests)]
    assert messages == [
        "params['0.wieght'] names a parameter the module (Sequential) lacks; did you mean '0.weight'?",
        "params['bais'] names a parameter the module (Sequential) lacks",
        "params['weigth'] names a parameter the module (Linear) lacks; did you mean 'weight'?",
        "params['bais'] names a parameter the module (Linear) lacks",
    ]


def test_placement_arithmetic_runs_in_one_rust_call(monkeypatch: pytest.MonkeyPatch) -> None:
    tables: list[CountingTable] = []
    real = meshbind._core.PlacementTable

    class CountingTable:
        def __init__(self, axes: Any, expert_axis: str) -> None:
            self.table, self.rows, self.checks = real(axes, expert_axis), 0, 0
            tables.append(self)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.table, name)

        def row(self, *args: Any) -> None:
            self.rows += 1
            self.table.row(*args)

        def check(self) -> Any:
            self.checks += 1
            return self.table.check()

    monkeypatch.setattr(meshbind.validation.batch._core, "PlacementTable", CountingTable)
    resolve_plan(Model(4), [HEAD_REQUEST, EXPERTS_REQUEST], CONTEXT)
    # One row per placement of each distinct sharding: these providers build one per module.
    assert [(table.checks, table.rows) for table in tables if table.checks] == [(1, 4 + 4 + 1)]


def test_overrides_merge_field_by_field() -> None:
    override = {"layers.1.mlp": {"in_src": {"ep": Replicate()}, "in_dst": {"ep": Replicate()}}}
    plan = resolve_plan(Model(), [EXPERTS_REQUEST], CONTEXT, overrides=override)
    merged = plan.sharding["layers.1.mlp"]
    assert merged.params["w1"] == {"ep": Shard(0)} and merged.in_src == {"ep": Replicate()}
    assert plan.sharding["layers.0.mlp"].in_src == {}


def test_later_overrides_win_and_bad_overrides_are_layout_problems() -> None:
    overrides = {"layers.*.mlp": {"params": {"w1": {"ep": Shard(1)}}}, "layers.0.mlp": {"params": {"w1": {"ep": Shard(0)}}}}
    with pytest.raises(PlanError) as caught:
        resolve_plan(Model(), [EXPERTS_REQUEST], CONTEXT, overrides=overrides)
    assert [(p.code, p.fqn) for p in caught.value.problems] == [("expert", "layers.1.mlp")]
    # The problem names the overrides that shaped the module's sharding beside its request.
    assert caught.value.problems[0].request == "requests[0], overrides['layers.*.mlp']"
    problems = problems_of(Model(), [EXPERTS_REQUEST], overrides={"layers.0.mlp": {"parms": {}}})
    assert problems[0].code == "layout" and "unknown sharding fields ['parms']" in problems[0].message
    assert problems[0].request == "overrides['layers.0.mlp']"


def test_an_override_selecting_no_planned_module_is_unmatched() -> None:
    problems = problems_of(
        Model(), [EXPERTS_REQUEST], overrides={"layers.0.norm": {"in_src": {}}, "layers.9.mlp": {"in_src": {}}}
    )
    assert [(p.code, p.request) for p in problems] == [
        ("unmatched", "overrides['layers.0.norm']"),
        ("unmatched", "overrides['layers.9.mlp']"),
    ]
    assert "does not select any planned module" in problems[0].message
    # Only a planned module can be meant: 'layers.0.norm' exists, but is no suggestion.
    assert problems[0].message.endswith("did you mean 'layers.0.attn', 'layers.0.mlp', 'layers.1.attn'?")


def test_shared_modules_are_keyed_by_their_first_fqn_and_selectable_by_any_alias() -> None:
    model = Model()
    model.tied = model.layers[0].mlp
    plan = resolve_plan(model, [NativeParallelBindingRequest(("tied",), EP_SPEC, experts_sharding)], CONTEXT)
    assert [fqn for fqn, spec in plan.parallel_modules.items() if spec is EP_SPEC] == ["layers.0.mlp"]


def test_cycles_are_layout_problems() -> None:
    model = Model()
    model.layers[0].norm.back = model.layers[0]  # type: ignore[assignment]
    problems = problems_of(model, [EXPERTS_REQUEST])
    assert [(p.code, p.fqn) for p in problems] == [("layout", "layers.0.norm.back")]
    assert "names its own ancestor 'layers.0'" in problems[0].message


def test_offline_resolution_over_fqns_with_shapes() -> None:
    names = ["", "layers", "layers.0", "layers.0.mlp", "layers.1", "layers.1.mlp"]
    shapes = {"layers.0.mlp.w1": (EXPERTS, 8, 16), "layers.1.mlp.w1": (6, 8, 16)}
    with pytest.raises(PlanError) as caught:
        resolve_plan(names, [EXPERTS_REQUEST], CONTEXT, param_shapes=shapes)
    [problem] = caught.value.problems
    assert (problem.code, problem.fqn) == ("expert", "layers.1.mlp") and "shape[0] is 6" in problem.message
    plan = resolve_plan(names, [EXPERTS_REQUEST], CONTEXT)
    assert [fqn for fqn in plan.parallel_modules if fqn.endswith("mlp")] == ["layers.0.mlp", "layers.1.mlp"]
    problems = problems_of(names, [EXPERTS_REQUEST], param_shapes={"layers.0.mlp.w1": (EXPERTS, 8)})
    assert [(p.code, p.fqn) for p in problems] == [("layout", "layers.1.mlp")]
    assert "no shape was given for parameter 'layers.1.mlp.w1'" in problems[0].message
    # The offline index records only matches; "did you mean" still searches every given FQN.
    typo = NativeParallelBindingRequest(("layers.*.mpl",), EP_SPEC, experts_sharding)
    [problem] = problems_of(names, [typo], param_shapes=shapes)
    assert problem.code == "unmatched" and "did you mean 'layers.0.mlp', 'layers.1.mlp'" in problem.message


@pytest.mark.parametrize(
    ("model", "requests", "context", "error"),
    [
        (["a", "a"], [], CONTEXT, "names 'a' more than once"),
        ("a.b", [], CONTEXT, "model must be an nn.Module"),
        (["a"], EXPERTS_REQUEST, CONTEXT, "requests must be a sequence"),
        (["a"], ["a"], CONTEXT, r"requests\[0\] must be a NativeParallelBindingRequest"),
        (["a"], [], {"ep": 2}, "context must be a LayoutContext"),
    ],
)
def test_bad_arguments_are_named(model: Any, requests: Any, context: Any, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        resolve_plan(model, requests, context)


@pytest.mark.parametrize(
    ("model", "shapes", "error"),
    [
        (["a"], [("a.w", (2,))], "param_shapes must map parameter FQNs to shapes"),
        (["a"], {1: (2,)}, "the key 1 must be a parameter FQN str"),
        (["a"], {"a.w": 5}, r"param_shapes\['a.w'\] must be a sequence of sizes"),
        (["a"], {"a.w": "ab"}, r"param_shapes\['a.w'\] must be a sequence of sizes"),
        (["a"], {"a.w": (-1, 3)}, r"param_shapes\['a.w'\] must be a sequence of sizes"),
        (["a"], {"a.w": (2**70, 3)}, r"from 0 to 2\*\*63 - 1, got \(1180591620717411303424, 3\)"),
        (nn.Linear(2, 2), {"weight": (2, 2)}, "param_shapes is for a sequence of FQNs"),
    ],
)
def test_bad_param_shapes_are_named(model: Any, shapes: Any, error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        resolve_plan(model, [EXPERTS_REQUEST], CONTEXT, param_shapes=shapes)


class Node(nn.Module):
    """A module that can be bound with any kind."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def bind_parallel(self, binding: object) -> None:
        self.binding = binding


KIND_SPECS = {
    kind: ParallelModuleSpec(f"node_{kind}", kind, stages={"forward": ("x",)}, validate=accept) for kind in ("cp", "mesh")
}


@st.composite
def shared_trees(draw: st.DrawFn) -> tuple[list[list[int]], dict[int, str]]:
    """A module DAG as each node's parents (lower nodes only, so aliases but no cycles), and a
    kind for some of its nodes."""
    count = draw(st.integers(2, 9))
    parents = [[]] + [draw(st.lists(st.integers(0, child - 1), min_size=1, max_size=2, unique=True)) for child in range(1, count)]
    kinds = draw(st.dictionaries(st.integers(0, count - 1), st.sampled_from(sorted(KIND_SPECS)), max_size=count))
    return parents, kinds


def _dag(parents: list[list[int]]) -> tuple[nn.Module, dict[int, str], dict[int, list[str]]]:
    """The DAG's root, and each node's first FQN and every FQN. Only the tree holds the modules
    (no list, no loop variable), so a module with one parent is held once, as in a model."""
    nodes = [Node() for _ in parents]
    for child, its_parents in enumerate(parents):
        for parent in its_parents:
            nodes[parent].add_module(f"c{child}", nodes[child])
    index = {id(module): node for node, module in enumerate(nodes)}
    root = nodes[0]
    del nodes
    first_fqn = {index[id(module)]: fqn for fqn, module in root.named_modules()}
    every_fqn: dict[int, list[str]] = {}
    for fqn, node in ((fqn, index[id(module)]) for fqn, module in root.named_modules(remove_duplicate=False)):
        every_fqn.setdefault(node, []).append(fqn)
    return root, first_fqn, every_fqn


@settings(max_examples=150, deadline=None)
@given(shared_trees())
@example(([[], [0], [0, 1], [2]], {3: "cp"}))  # named c2.c3, first met as c1.c2.c3: under a shared parent
def test_nested_matches_every_alias_of_named_modules(case: tuple[list[list[int]], dict[int, str]]) -> None:
    parents, kinds = case
    model, first_fqn, every_fqn = _dag(parents)
    expected = {
        first_fqn[inner]
        for inner, kind in kinds.items()
        for outer, outer_kind in kinds.items()
        if outer != inner and outer_kind == kind
        for name in every_fqn[inner]
        for prefix in every_fqn[outer]
        if name != prefix and (prefix == "" or name.startswith(prefix + "."))
    }
    requests = [
        NativeParallelBindingRequest(
            tuple(every_fqn[node][-1] for node, k in kinds.items() if k == kind), spec, lambda m, f, c: ModuleShardingSpec()
        )
        for kind, spec in KIND_SPECS.items()
        if kind in kinds.values()
    ]
    for family_class_loaded in (False, True):  # pruned walk, full walk
        with mock.patch.object(
            meshbind.resolution.selection, "family_classes_declared", lambda loaded=family_class_loaded: loaded
        ):
            try:
                planned = set(resolve_plan(model, requests, CONTEXT).parallel_modules)
                nested = set()
            except PlanError as error:
                planned = {first_fqn[node] for node in kinds}
                nested = {p.fqn for p in error.problems if p.code == "nested"}
        assert nested == expected, (family_class_loaded, kinds, sorted(every_fqn.values()))
        assert planned == {first_fqn[node] for node in kinds}, (family_class_loaded, kinds, sorted(every_fqn.values()))


def _tree_of(fqns: list[str]) -> nn.Module:
    """A tree of ``Node`` modules holding every FQN (and each prefix); only the tree holds them."""
    root = Node()
    for fqn in fqns:
        module = root
        for segment in fqn.split(".") if fqn else []:
            if segment not in module._modules:
                module.add_module(segment, Node())
            module = module._modules[segment]  # type: ignore[assignment]
    return root


PLAN_SPECS = [ParallelModuleSpec("node", stages={"forward": ("x",)}), *KIND_SPECS.values()]
PROVIDERS = [
    lambda m, f, c: ModuleShardingSpec(),
    lambda m, f, c: ModuleShardingSpec(params={"weight": {"tp": Replicate()}}),  # Node has none: a layout problem
]


def _selecting(draw: st.DrawFn, fqns: list[str]) -> str:
    """A pattern likely to select something: a random one, or one of the FQNs with some segments
    made ``*`` or ``**``."""
    if draw(st.booleans()):
        return draw(patterns())
    segments = draw(st.sampled_from(fqns)).split(".")
    return ".".join(draw(st.sampled_from([segment, "*", "**"])) if segment else "" for segment in segments)


@st.composite
def plans_over_trees(draw: st.DrawFn) -> tuple[list[str], list[NativeParallelBindingRequest], dict[str, Any]]:
    """FQNs, requests of patterns, specs and providers, and perhaps an override."""
    fqns = draw(st.lists(names, min_size=1, max_size=8))
    requests = [
        NativeParallelBindingRequest(
            tuple(_selecting(draw, fqns) for _ in range(draw(st.integers(1, 2)))),
            draw(st.sampled_from(PLAN_SPECS)),
            draw(st.sampled_from(PROVIDERS)),
        )
        for _ in range(draw(st.integers(1, 3)))
    ]
    layout = {"in_src": {"cp": Replicate()}, "in_dst": {"cp": Replicate()}}
    overrides = {_selecting(draw, fqns): layout} if draw(st.booleans()) else {}
    return fqns, requests, overrides


@settings(max_examples=300, deadline=None)
@given(plans_over_trees())
def test_pruning_the_walk_changes_no_plan_and_no_problem(
    case: tuple[list[str], list[NativeParallelBindingRequest], dict[str, Any]],
) -> None:
    """Where no family class exists the walk skips subtrees no pattern reaches: the plan, or every
    problem with its message (suggestions included), is what the full walk gives. Offline, over the
    tree's FQNs, it is the same too when no provider names a parameter (offline it has no shape)."""
    fqns, requests, overrides = case

    def outcome(model: nn.Module | list[str]) -> object:
        try:
            plan = resolve_plan(model, requests, CONTEXT, overrides=overrides)
        except PlanError as error:
            return [(p.code, p.fqn, p.request, p.message) for p in error.problems]
        return list(plan.parallel_modules.items()), dict(plan.sharding), dict(plan.sources)

    with mock.patch.object(meshbind.resolution.selection, "family_classes_declared", lambda: False):
        pruned = outcome(_tree_of(fqns))
    with mock.patch.object(meshbind.resolution.selection, "family_classes_declared", lambda: True):
        assert outcome(_tree_of(fqns)) == pruned
    if all(request.sharding is PROVIDERS[0] for request in requests):
        assert outcome([name for name, _ in _tree_of(fqns).named_modules()]) == pruned


def test_an_optional_request_that_selects_nothing_is_a_warning_not_a_problem() -> None:
    optional = NativeParallelBindingRequest(("layers.*.mlp.expertz",), EP_SPEC, experts_sharding, required=False)
    plan = resolve_plan(Model(), [EXPERTS_REQUEST, optional], CONTEXT)
    assert [fqn for fqn in plan.parallel_modules if fqn.endswith("mlp")] == ["layers.0.mlp", "layers.1.mlp"]
    [warning] = plan.warnings
    assert (warning.code, warning.fqn, warning.request) == ("unmatched", None, "requests[1]")
    assert "pattern 'layers.*.mlp.expertz' does not select any module; did you mean" in warning.message
    assert "warning: unmatched (pattern): pattern 'layers.*.mlp.expertz'" in plan.explain()
    assert json.loads(json.dumps(plan.to_dict()))["warnings"][0]["request"] == "requests[1]"
    # Required (the default), the same pattern is a problem.
    required = dataclasses.replace(optional, required=True)
    assert [p.code for p in problems_of(Model(), [EXPERTS_REQUEST, required])] == ["unmatched"]
    assert resolve_plan(Model(), [EXPERTS_REQUEST], CONTEXT).warnings == ()


def test_problems_sort_numbers_numerically_and_the_text_groups_them_by_layer_index() -> None:
    model = Model(12)
    problems = problems_of(model, [EXPERTS_REQUEST], context=LayoutContext({"cp": 6, "ep": 3}))
    expert = [p for p in problems if p.code == "expert"]
    assert [p.fqn for p in expert] == [f"layers.{i}.mlp" for i in range(12)]  # layers.2 before layers.10
    with pytest.raises(PlanError) as caught:
        resolve_plan(model, [EXPERTS_REQUEST], LayoutContext({"cp": 6, "ep": 3}))
    lines = str(caught.value).splitlines()
    assert lines[0] == "the plan has 24 problems:"
    grouped = "  expert    12 modules 'layers.<0-11>.mlp': num_experts 4 is not divisible by the 'ep' axis size 3 [requests[0]]"
    assert grouped in lines
    assert len(lines) == 3  # the expert and the layout problems, one line each


def test_indices_that_are_no_run_are_listed_and_different_messages_stay_apart() -> None:
    found = [meshbind.PlanProblem("expert", f"layers.{i}.mlp", "requests[0]", "too few experts") for i in (0, 2, 7)] + [
        meshbind.PlanProblem("expert", "layers.3.mlp", "requests[0]", "another reason")
    ]
    text = str(PlanError(found))
    assert "expert    3 modules 'layers.{0,2,7}.mlp': too few experts [requests[0]]" in text
    assert "expert    'layers.3.mlp': another reason [requests[0]]" in text
    assert [p.fqn for p in PlanError(found).problems] == ["layers.0.mlp", "layers.2.mlp", "layers.3.mlp", "layers.7.mlp"]


def test_a_parameter_written_as_a_module_pattern_gets_did_you_mean_among_parameters() -> None:
    request = NativeParallelBindingRequest(("layers.0.mlp.w_1",), LINEAR_SPEC, linear_sharding)
    [problem] = problems_of(Model(), [request])
    assert problem.code == "unmatched"
    assert "did you mean 'layers.0.mlp.w1' (a parameter of 'layers.0.mlp')" in problem.message
    # Offline there are only the FQNs given, all of them modules.
    [offline] = problems_of(["", "layers", "layers.0"], [NativeParallelBindingRequest(("layer",), LINEAR_SPEC, linear_sharding)])
    assert "did you mean 'layers', 'layers.0'?" in offline.message and "parameter" not in offline.message


def test_a_pattern_selecting_parameters_plans_the_modules_that_hold_them() -> None:
    by_parameter = NativeParallelBindingRequest(("layers.*.mlp.w1",), EP_SPEC, experts_sharding)
    plan = resolve_plan(Model(), [by_parameter, HEAD_REQUEST], CONTEXT)
    by_name = resolve_plan(Model(), [EXPERTS_REQUEST, HEAD_REQUEST], CONTEXT)
    assert list(plan.parallel_modules) == list(by_name.parallel_modules)
    assert [plan.sources[f"layers.{i}.mlp"] for i in range(2)] == ["requests[0]", "requests[0]"]
    assert plan.sharding["layers.0.mlp"].params == {"w1": {"ep": Shard(0)}}
    # Two requests reaching one module, through a parameter and by name, with different specs conflict.
    by_both = [by_parameter, NativeParallelBindingRequest(("layers.0.mlp",), LINEAR_SPEC, linear_sharding)]
    assert [(p.code, p.fqn) for p in problems_of(Model(), by_both)] == [("conflict", "layers.0.mlp")]
