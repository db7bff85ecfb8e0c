"""SPEC §5: each rule of validate_parallel_module, in order, on real modules."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from meshbind import LayoutContext, ModuleShardingSpec, ParallelModuleSpec, _core, validate_parallel_module
from meshbind.errors import ProblemCode
from meshbind.names import PlacementKind
from meshbind.validation import ValidationBatch, rules

CONTEXT = LayoutContext({"dp_shard": 2, "ep": 2, "tp": 1})


def accept(**kwargs: Any) -> None:
    return None


class Experts(nn.Module):
    """A fused-expert module with an explicit stage and a binding hook."""

    def __init__(self, num_experts: int = 4) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, 8, 16, device="meta"))

    def route(self, tokens: torch.Tensor, *, expert_ids: torch.Tensor) -> torch.Tensor:
        return tokens

    def bind_parallel(self, binding: object) -> None:
        self.binding = binding


def ep_spec(num_experts: object = 4, validate: Any = accept, **stages: tuple[str, ...]) -> ParallelModuleSpec:
    return ParallelModuleSpec(
        "moe",
        "ep",
        stages=stages or {"route": ("tokens", "expert_ids")},
        validate=validate,
        options={"num_experts": num_experts},
    )


OWNED = ModuleShardingSpec(params={"w1": {"ep": Shard(0)}})


def fails(
    module: nn.Module, spec: ParallelModuleSpec, sharding: ModuleShardingSpec, match: str, context: LayoutContext = CONTEXT
) -> None:
    with pytest.raises(ValueError, match=match):
        validate_parallel_module(module, spec, sharding, context)


def test_a_valid_ep_module_passes() -> None:
    validate_parallel_module(Experts(), ep_spec(), OWNED, CONTEXT)


# Rule 1: stages are callables of the class, accepting their keywords.


def test_a_missing_stage_fails() -> None:
    fails(Experts(), ep_spec(dispatch=("tokens",)), OWNED, r"\[stage\].*'dispatch' is not defined")


def test_an_instance_attribute_is_not_a_stage() -> None:
    module = Experts()
    module.__dict__["dispatch"] = lambda tokens: tokens
    fails(module, ep_spec(dispatch=("tokens",)), OWNED, r"\[stage\].*instance attribute does not count")


def test_a_stage_must_accept_each_keyword() -> None:
    fails(Experts(), ep_spec(route=("tokens", "weights")), OWNED, r"\[stage\].*route does not accept")


def test_self_is_not_a_keyword_of_a_stage() -> None:
    fails(Experts(), ep_spec(route=("self",)), OWNED, r"\[stage\]")


def test_var_keyword_and_static_stages_are_accepted() -> None:
    class Flexible(Experts):
        def forward(self, **inputs: torch.Tensor) -> None:
            return None

        @staticmethod
        def combine(out: torch.Tensor) -> torch.Tensor:
            return out

    validate_parallel_module(Flexible(), ep_spec(forward=("x", "y"), combine=("out",)), OWNED, CONTEXT)


def test_a_non_callable_stage_fails() -> None:
    class WithData(Experts):
        route = 3  # type: ignore[assignment]

    fails(WithData(), ep_spec(), OWNED, r"\[stage\].*not callable")


# Rule 2: a bound kind needs bind_parallel(binding).


def test_a_bound_kind_needs_bind_parallel() -> None:
    class Unbindable(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    spec = ParallelModuleSpec("attn", "cp", stages={"forward": ("x",)}, validate=accept)
    fails(Unbindable(), spec, ModuleShardingSpec(), r"\[binding\].*bind_parallel")
    validate_parallel_module(Unbindable(), ParallelModuleSpec("plain", stages={"forward": ("x",)}), ModuleShardingSpec(), CONTEXT)


def test_bind_parallel_must_take_one_positional_argument() -> None:
    class TwoArguments(Experts):
        def bind_parallel(self, binding: object, extra: object) -> None:  # type: ignore[override]
            return None

    fails(TwoArguments(), ep_spec(), OWNED, r"\[binding\].*one positional argument")


# Rule 3: no expert stack.


def test_an_expert_stack_fails() -> None:
    stacked = ModuleShardingSpec(params={"w1": {"ep": Shard(0)}}, expert_stack=4)
    fails(Experts(), ep_spec(), stacked, r"\[expert\].*stacks 4 per-expert modules")


# Rule 4: the module receives and restores its own layouts.


def test_in_src_must_equal_in_dst() -> None:
    sharding = ModuleShardingSpec(params={"w1": {"ep": Shard(0)}}, in_src={"tp": Replicate()}, in_dst={"tp": Shard(1)})
    fails(Experts(), ep_spec(), sharding, r"\[stage\].*in_src .* differs from in_dst")


def test_out_src_must_equal_a_set_out_dst() -> None:
    sharding = ModuleShardingSpec(params={"w1": {"ep": Shard(0)}}, out_src={"tp": Replicate()}, out_dst={"tp": Shard(0)})
    fails(Experts(), ep_spec(), sharding, r"\[stage\].*out_src .* differs from out_dst")
    unset = ModuleShardingSpec(params={"w1": {"ep": Shard(0)}}, out_src={"tp": Replicate()})
    validate_parallel_module(Experts(), ep_spec(), unset, CONTEXT)


# Rule 5: expert arithmetic (checked in Rust).


@pytest.mark.parametrize(
    ("num_experts", "match"),
    [
        (True, "must be an int, got bool"),
        (4.0, "must be an int"),
        (0, "at least 1"),
        (-(2**70), "at least 1"),
        (2**70, "at most 2\\*\\*63 - 1"),
        (3, "not divisible by the 'ep' axis size 2"),
    ],
)
def test_num_experts_must_be_a_positive_int_divisible_by_ep(num_experts: object, match: str) -> None:
    fails(Experts(4), ep_spec(num_experts), OWNED, rf"\[expert\].*{match}")


def test_a_context_without_ep_is_a_clear_error() -> None:
    fails(
        Experts(),
        ep_spec(),
        ModuleShardingSpec(params={"w1": {"dp": Replicate()}}),
        r"\[expert\].*no 'ep' axis",
        LayoutContext({"dp": 2}),
    )


def test_some_parameter_must_be_sharded_on_ep() -> None:
    fails(Experts(), ep_spec(), ModuleShardingSpec(params={"w1": {"ep": Replicate()}}), r"\[expert\].*no parameter is Shard")
    inputs_only = ModuleShardingSpec(params={"w1": {"ep": Replicate()}}, in_src={"ep": Shard(0)}, in_dst={"ep": Shard(0)})
    fails(Experts(), ep_spec(), inputs_only, r"\[expert\].*no parameter is Shard")


def test_ep_ownership_must_be_shard_zero() -> None:
    fails(Experts(), ep_spec(), ModuleShardingSpec(params={"w1": {"ep": Shard(1)}}), r"\[expert\].*must be Shard\(0\)")
    fails(
        Experts(), ep_spec(), ModuleShardingSpec(params={"w1": {"ep": Shard(-1)}}), r"\[expert\].*Shard\(-1\).*must be Shard\(0\)"
    )


def test_the_shape_is_checked_whatever_else_places_the_parameter() -> None:
    for placements in ({"ep": Shard(0), "tp": Replicate()}, {"tp": Replicate(), "ep": Shard(0)}):
        fails(Experts(8), ep_spec(4), ModuleShardingSpec(params={"w1": placements}), r"\[expert\].*shape\[0\] is 8")


def test_a_negative_shard_dim_counts_from_the_end_as_in_torch() -> None:
    validate_parallel_module(Experts(), ep_spec(), ModuleShardingSpec(params={"w1": {"ep": Shard(-3)}}), CONTEXT)


def test_shape_zero_must_equal_num_experts() -> None:
    fails(Experts(8), ep_spec(4), OWNED, r"\[expert\].*shape\[0\] is 8, not num_experts 4")


# Rule 6: the spec's own validator, last.


def test_the_validator_runs_last_with_keywords() -> None:
    seen: dict[str, Any] = {}

    def record(*, module: nn.Module, sharding: ModuleShardingSpec, context: LayoutContext) -> None:
        seen.update(module=module, sharding=sharding, context=context)

    module = Experts()
    validate_parallel_module(module, ep_spec(validate=record), OWNED, CONTEXT)
    assert seen == {"module": module, "sharding": OWNED, "context": CONTEXT}

    def refuse(**kwargs: Any) -> None:
        raise RuntimeError("hidden size too small")

    fails(module, ep_spec(validate=refuse), OWNED, r"\[validator\].*RuntimeError: hidden size too small")
    # A verdict returned instead of raised is no pass: False would otherwise be ignored.
    fails(module, ep_spec(validate=lambda **kwargs: False), OWNED, r"\[validator\].*validate returned False: .* raises to reject")
    fails(module, ep_spec(3, validate=refuse), OWNED, r"\[expert\]")


def test_the_first_failing_rule_is_reported() -> None:
    def refuse(**kwargs: Any) -> None:
        raise RuntimeError("never reached")

    stacked = ModuleShardingSpec(params={"w1": {"ep": Shard(1)}}, expert_stack=2)
    fails(Experts(), ep_spec(3, validate=refuse, route=("nope",)), stacked, r"\[stage\]")
    fails(Experts(), ep_spec(3, validate=refuse), stacked, r"\[expert\].*stacks")


# The layout checks run in validate_parallel_module too.


def test_layout_problems_fail_single_module_validation() -> None:
    fails(
        Experts(),
        ep_spec(),
        ModuleShardingSpec(params={"w1": {"ep": Shard(0)}, "w9": {"ep": Shard(0)}}),
        r"\[layout\].*'w9'.*lacks",
    )
    fails(
        Experts(),
        ep_spec(),
        ModuleShardingSpec(params={"w1": {"ep": Shard(0), "tp": Shard(3)}}),
        r"\[layout\].*Shard\(3\).*rank 3",
    )
    fails(
        Experts(), ep_spec(), ModuleShardingSpec(params={"w1": {"ep": Shard(0), "cp": Replicate()}}), r"\[layout\].*'cp'.*lacks"
    )


class HomeMadePlacement(Placement):
    """A placement of our own: meshbind checks torch's Shard, Replicate and Partial only."""


def test_a_placement_that_is_not_torchs_own_is_a_layout_problem() -> None:
    sharding = ModuleShardingSpec(params={"w1": {"ep": Shard(0), "tp": HomeMadePlacement()}})
    fails(Experts(), ep_spec(), sharding, r"\[layout\] .*params\['w1'\] on axis 'tp' is an unsupported placement")


def test_wrong_argument_types_are_named() -> None:
    with pytest.raises(TypeError, match="sharding must be a ModuleShardingSpec"):
        validate_parallel_module(Experts(), ep_spec(), {"w1": {}}, CONTEXT)  # type: ignore[arg-type]


def test_the_modules_lacking_a_parameter_are_found_across_a_long_list() -> None:
    # Longer than the look-ahead, several classes (each learned once), some instances changed.
    modules: list[nn.Module] = [nn.Linear(2, 2, device="meta") if i % 7 else nn.ReLU() for i in range(300)]
    modules[40] = Experts()
    del modules[101]._parameters["weight"]
    modules[150]._parameters = {"weight": None}  # a plain dict standing in: getattr sees it
    modules[151].__dict__["_parameters"] = {}
    expected = [i for i, module in enumerate(modules) if "weight" not in module._parameters]
    assert 101 in expected and 151 in expected and 150 not in expected
    assert _core.modules_lacking(modules, "weight") == expected
    rows = list(range(0, 300, 3))[::-1]
    assert _core.modules_lacking(modules, "weight", rows) == [k for k, row in enumerate(rows) if row in expected]
    with pytest.raises(IndexError, match="row 300 is beyond the 300 modules"):
        _core.modules_lacking(modules, "weight", [0, 300])
    modules[200]._parameters = ["weight"]  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"modules\[200\]._parameters is a list, not a dict"):
        _core.modules_lacking(modules, "weight")


def test_the_expert_rule_reads_the_axis_the_world_names() -> None:
    # Rule 5 (num_experts divisible by the expert axis) follows the name it is given, not a spelling of its own.
    for expert_axis, problems in (("ep", 1), ("experts", 0)):
        table = _core.PlacementTable([("ep", 3), ("experts", 4)], expert_axis)
        unit = table.unit(8)
        label = table.label("params['w']", True)
        table.row(unit, label, table.axis(expert_axis), PlacementKind.SHARD, dim=0, rank=2, first_dim=8, dim_size=8)
        problems_found = [problem.message for problem in table.check() if problem.code is ProblemCode.EXPERT]
        assert len(problems_found) == problems, problems_found


@pytest.mark.parametrize("ep_size", [0, -2])
def test_the_placement_table_rejects_a_size_it_cannot_divide_by(ep_size: int) -> None:
    # Only a direct call can hand Rust such a size (LayoutContext refuses it): a ValueError, not a panic.
    with pytest.raises(ValueError, match=f'axis size {ep_size} of "ep" must be positive'):
        _core.PlacementTable([("ep", ep_size)], "ep")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"label": 4}, "no label 4"),
        ({"axis": 4}, "no axis 4"),
        ({"unit": 5}, "no unit 5"),
    ],
)
def test_the_placement_table_refuses_rows_it_cannot_index(row: dict[str, Any], message: str) -> None:
    """A row naming what the table lacks is a ValueError, never a panic from an index."""
    table = _core.PlacementTable([("ep", 2)], "ep")
    fields = {
        "unit": table.unit(8),
        "label": table.label("params['w']", True),
        "axis": table.axis("ep"),
        "kind": PlacementKind.SHARD,
    }
    with pytest.raises(ValueError, match=message):
        table.row(**{**fields, **row}, dim=0, rank=3, first_dim=8)
    with pytest.raises(TypeError, match="kind"):  # a kind crosses as the enum's member, never as text
        table.row(**{**fields, "kind": "shard"}, dim=0, rank=3, first_dim=8)
    with pytest.raises(ValueError, match="num_experts 0 must be at least 1"):
        table.unit(0)
    table.row(**fields, dim=0, rank=3, first_dim=8)
    assert table.check() == []


class SomeExperts(nn.Module):
    """Fused experts of a drawn count, with or without a second weight; a valid stage and binding."""

    def __init__(self, num_experts: int, second_weight: bool) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, 4, device="meta"))
        if second_weight:
            self.w2 = nn.Parameter(torch.empty(num_experts, 4, 2, device="meta"))

    def route(self, tokens: torch.Tensor, *, expert_ids: torch.Tensor) -> torch.Tensor:
        return tokens

    def bind_parallel(self, binding: object) -> None:
        self.binding = binding


BATCH_SPECS = [ep_spec(2), ep_spec(4), ep_spec(8), ParallelModuleSpec("plain", stages={"route": ("tokens",)})]
BATCH_SHARDINGS = [
    OWNED,
    ModuleShardingSpec(params={"w1": {"ep": Shard(0)}, "w2": {"ep": Shard(0), "tp": Replicate()}}),
    ModuleShardingSpec(params={"w1": {"ep": Shard(1)}}),
    ModuleShardingSpec(params={"w1": {"ep": Replicate()}}),
    ModuleShardingSpec(params={"w1": {"ep": Shard(0), "tp": Shard(2)}}),
    ModuleShardingSpec(params={"w2": {"ep": Shard(-3)}}),
    ModuleShardingSpec(params={"w1": {"cp": Replicate()}}),
    ModuleShardingSpec(params={"w1": {"ep": Shard(0)}}, in_src={"tp": Shard(0)}),
]


@st.composite
def batches(draw: st.DrawFn) -> tuple[LayoutContext, list[tuple[nn.Module, ParallelModuleSpec, ModuleShardingSpec]]]:
    """A context and modules with specs and shardings drawn from small pools, so that many share
    a spec, a sharding object (or an equal copy) and shapes: what the batch checks as one unit."""
    context = LayoutContext(
        draw(st.sampled_from([{"dp_shard": 2, "ep": 2, "tp": 1}, {"dp_shard": 2, "ep": 4, "tp": 2}, {"dp": 2}]))
    )
    rows = []
    for _ in range(draw(st.integers(1, 12))):
        module = SomeExperts(draw(st.sampled_from([2, 4, 8])), draw(st.booleans()))
        sharding = draw(st.sampled_from(BATCH_SHARDINGS))
        if draw(st.booleans()):
            sharding = dataclasses.replace(sharding)  # equal, but another object
        rows.append((module, draw(st.sampled_from(BATCH_SPECS)), sharding))
    return context, rows


@settings(max_examples=300, deadline=None)
@given(batches())
def test_a_batch_finds_for_each_module_what_it_finds_for_that_module_alone(
    case: tuple[LayoutContext, list[tuple[nn.Module, ParallelModuleSpec, ModuleShardingSpec]]],
) -> None:
    """Grouping modules into units (by sharding object, expert count and shapes) changes no answer."""
    context, rows = case
    modules, specs, shardings = (list(column) for column in zip(*rows, strict=True))
    fqns = [f"experts.{index}" for index in range(len(rows))]
    together: dict[int, list[tuple[str, str]]] = {}
    for row, code, message in ValidationBatch(context).check(modules, fqns, specs, shardings):
        together.setdefault(row, []).append((code, message))
    for row in range(len(rows)):
        alone = ValidationBatch(context).check([modules[row]], [fqns[row]], [specs[row]], [shardings[row]])
        assert sorted(together.get(row, [])) == sorted((code, message) for _, code, message in alone), rows[row]


def _stage_forms() -> list[type]:
    """Classes whose ``forward`` and ``bind_parallel`` take every form a signature may take."""
    forms: dict[str, Any] = {
        "plain": "def f(self, x, tokens=None): pass",
        "keyword_only": "def f(self, *, tokens): pass",
        "var_keyword": "def f(self, **kwargs): pass",
        "positional_only": "def f(self, tokens, /): pass",
        "self_positional_only": "def f(self, /, tokens): pass",
        "no_self": "def f(): pass",
        "var_positional": "def f(self, *args): pass",
        "two_required": "def f(self, a, b): pass",
        "defaults": "def f(self, a, b=1, *, c=2): pass",
        "required_keyword": "def f(self, a, *, c): pass",
        "self_only": "def f(self): pass",
        "named_self_keyword": "def f(self, x): pass",
    }
    classes = []
    for name, source in forms.items():
        namespace: dict[str, Any] = {}
        exec(source, namespace)
        function = namespace["f"]
        classes.append(type(name, (nn.Module,), {"forward": function, "bind_parallel": function}))
    wrapped = classes[0].forward

    @functools.wraps(wrapped)
    def decorated(*args: Any, **kwargs: Any) -> None:
        return None

    classes.append(type("decorated", (nn.Module,), {"forward": decorated, "bind_parallel": decorated}))
    classes.append(
        type(
            "static", (nn.Module,), {"forward": staticmethod(lambda tokens: None), "bind_parallel": staticmethod(lambda b: None)}
        )
    )
    return classes


@pytest.mark.parametrize("cls", _stage_forms(), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("keywords", [(), ("tokens",), ("x",), ("self",), ("tokens", "c")])
@pytest.mark.parametrize("binding_kind", ["none", "cp"])
def test_the_fast_class_rules_pass_only_what_inspect_passes(
    cls: type, keywords: tuple[str, ...], binding_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = ParallelModuleSpec("p", binding_kind, stages={"forward": keywords}, validate=lambda **kwargs: None)
    fast = rules.surely_passes(cls, spec)
    monkeypatch.setattr(rules, "surely_passes", lambda cls, spec: False)
    verdict = rules.class_failure(cls, spec)
    assert not fast or verdict is None, f"read from the code as passing, but inspect says {verdict}"
    if cls.__name__ in ("plain", "var_keyword", "defaults") and verdict is None:
        assert fast, "a plain function that passes is read from its code"


def test_rows_group_by_the_identity_of_their_objects_in_every_column() -> None:
    first, equal_twin = ModuleShardingSpec(), ModuleShardingSpec()
    assert first == equal_twin
    spec = ep_spec()
    specs = [spec, spec, spec, spec]
    shardings = [first, equal_twin, first, first]
    classes = [nn.Linear, nn.Linear, nn.Linear, nn.ReLU]
    assert _core.same_object_groups([specs, shardings, classes]) == [[0, 2], [1], [3]]
    with pytest.raises(ValueError, match="column 1 has 3 rows, not 4"):
        _core.same_object_groups([specs, shardings[:3]])


def test_validate_parallel_module_runs_the_class_rules_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rules 1-4 run before the layout checks, and the bulk pass that runs those does not run them again."""
    import meshbind.validation as validation
    import meshbind.validation.rules as rules

    calls: list[type] = []
    original = rules.class_failure

    def counted(cls: type, spec: ParallelModuleSpec) -> object:
        calls.append(cls)
        return original(cls, spec)

    monkeypatch.setattr(rules, "class_failure", counted)
    monkeypatch.setattr(validation, "class_failure", counted)
    validate_parallel_module(Experts(), ep_spec(), OWNED, CONTEXT)
    assert calls == [Experts]
