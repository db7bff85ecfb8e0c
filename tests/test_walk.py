"""The Rust tree walk (SPEC §4 walk rules) against torch's own named_modules()."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from meshbind import PatternSet
from meshbind.examples.moe_tree import DEEP_PLAN, build_moe_tree, moe_tree_fqns

from reference_matcher import reference_match


@pytest.fixture(scope="module")
def moe() -> nn.Module:
    return build_moe_tree(3, 6)


def test_full_walk_visits_named_modules_in_order(moe: nn.Module) -> None:
    tree = PatternSet([]).walk(moe, prune=False)
    assert tree.complete
    expected = [name for name, _ in moe.named_modules()]
    assert tree.names() == expected == moe_tree_fqns(3, 6)
    assert tree.module_names() == expected
    assert tree.modules([0, 5]) == [moe, dict(moe.named_modules())[expected[5]]]


def test_matches_agree_with_reference_pruned_or_not(moe: nn.Module) -> None:
    patterns = [*DEEP_PLAN, "**.down_proj", "layers.<1-2>.**", "re:layers\\.0\\..*norm", "", "nothing.here"]
    ps = PatternSet(patterns)
    expected = [(name, [i for i, p in enumerate(patterns) if reference_match(p, name)]) for name, _ in moe.named_modules()]
    expected = [(n, hits) for n, hits in expected if hits]
    assert ps.walk(moe, prune=False).matches() == expected
    pruned = ps.walk(moe)
    assert pruned.matches() == expected
    assert not pruned.complete
    assert pruned.hit_counts()[-1] == 0


def test_aliases_of_shared_modules_are_candidates_keyed_by_first_fqn() -> None:
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    tree = PatternSet(["*.0"]).walk(model, prune=False)
    assert tree.names() == ["", "a", "a.0", "b", "b.0"]
    modules = tree.name_modules()
    assert modules[2] == modules[4]
    assert tree.module_names()[modules[4]] == "a.0"
    assert tree.matches() == [("a.0", [0]), ("b.0", [0])]


def test_cycles_are_reported_not_followed() -> None:
    outer = nn.Sequential(nn.Linear(2, 2))
    inner = nn.Sequential(nn.ReLU())
    outer.append(inner)
    inner.append(outer)
    for prune in (True, False):
        tree = PatternSet(["**"]).walk(outer, prune=prune)
        assert tree.cycles() == [("1.1", "")]
        assert "1.1" in tree.names()


class _LateModules(nn.Module):
    """A module whose ``_modules`` sits late in its instance dict (attributes set before
    ``Module.__init__``), so instances of other classes reassigned to it hold fewer values."""

    def __init__(self) -> None:
        for index in range(8):
            object.__setattr__(self, f"early{index}", index)
        super().__init__()
        self.inner = nn.ReLU()


def _odd_wide_list() -> nn.ModuleList:
    """A wide module (the walk looks ahead over its children) whose children vary in every way
    CPython lays a module out: holes left by deleted entries, None, a shared child, an instance
    dict replaced by a plain one, reassigned classes, an OrderedDict of children."""
    experts = nn.ModuleList(nn.Sequential(nn.Linear(1, 1), nn.ReLU()) for _ in range(120))
    experts[20] = _LateModules()
    experts[21] = nn.ReLU()
    experts[21].__class__ = _LateModules
    for index in range(0, 120, 9):
        del experts._modules[str(index)]
    experts._modules["none"] = None
    experts._modules["alias"] = experts[5]
    experts[10].__dict__ = dict(experts[10].__dict__)
    experts[11].__class__ = nn.ModuleList
    experts[12]._modules = OrderedDict(experts[12]._modules)
    experts[13].extra = nn.ModuleList(nn.Identity() for _ in range(40))
    return experts


def test_wide_modules_walk_like_named_modules_whatever_their_layout() -> None:
    model = nn.ModuleDict({"a": _odd_wide_list(), "b": _odd_wide_list()})
    expected = [name for name, _ in model.named_modules(remove_duplicate=False)]
    assert PatternSet([]).walk(model, prune=False).names() == expected
    patterns = ["*.*.0", "b.1?.**", "a.alias.1", "*.13.extra.3?"]
    hits = [(n, [i for i, p in enumerate(patterns) if reference_match(p, n)]) for n in expected]
    assert PatternSet(patterns).walk(model).matches() == [(n, h) for n, h in hits if h]


def _without_hidden(children: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """``children`` itself, or a copy without the child named ``hidden`` where there is one."""
    if "hidden" not in children:
        return children
    return {key: child for key, child in children.items() if key != "hidden"}


class _ViewedModules(nn.Module):
    """``_modules`` as ``__getattribute__`` shows it: without the child named ``hidden``."""

    def __getattribute__(self, name: str) -> object:
        found = super().__getattribute__(name)
        return _without_hidden(found) if name == "_modules" else found  # type: ignore[arg-type]


class _DescribedModules(nn.Module):
    """``_modules`` behind a class property, which shows every child but ``hidden``."""

    @property  # type: ignore[override]
    def _modules(self) -> dict[str, nn.Module]:
        return _without_hidden(self.__dict__["_modules"])

    @_modules.setter
    def _modules(self, value: dict[str, nn.Module]) -> None:
        self.__dict__["_modules"] = value


def test_the_walk_reads_modules_as_getattr_does() -> None:
    """Where ``getattr(module, "_modules")`` is not always the instance dict's entry, the walk
    (which reads the entry in place for plain classes) follows ``getattr``, as ``named_modules``
    does — also after an instance of the class whose ``getattr`` gave the entry itself."""
    model = nn.ModuleList()
    for hide in (False, True, True):
        for kind in (nn.Sequential, _ViewedModules, _DescribedModules):
            module = kind()
            module.add_module("shown", nn.ReLU())
            if hide:
                module.__dict__["_modules"]["hidden"] = nn.ReLU()
            model.append(module)
    expected = [name for name, _ in model.named_modules(remove_duplicate=False)]
    assert sum(name.endswith("hidden") for name in expected) == 2
    assert PatternSet([]).walk(model, prune=False).names() == expected
    assert PatternSet(["*.hidden"]).walk(model).names() == [n for n in expected if n.endswith("hidden")]


def _give_later_siblings_a_child(module: nn.Module) -> None:
    """Once: every sibling after ``module`` gets a new ``_modules`` dict, with a child ``extra``."""
    siblings = module.__dict__.pop("siblings", None)
    if siblings is None:
        return
    later = list(siblings)
    for sibling in later[later.index(module) + 1 :]:
        sibling.__dict__["_modules"] = {**sibling.__dict__["_modules"], "extra": nn.ReLU()}


class _ChangesSiblingsInGetattribute(nn.Module):
    def __getattribute__(self, name: str) -> Any:
        if name == "_modules":
            _give_later_siblings_a_child(self)
        return super().__getattribute__(name)


class _ChangesSiblingsInGetattr(nn.Module):
    """Its ``_modules`` is not in its instance dict: ``__getattr__`` gives it."""

    def __getattr__(self, name: str) -> Any:
        if name == "_modules":
            _give_later_siblings_a_child(self)
            return self.__dict__["kept_modules"]
        return super().__getattr__(name)


class _ChangesSiblingsInParameters(nn.Module):
    """``_parameters`` behind a class property, read by a walk that reads parameters."""

    @property  # type: ignore[override]
    def _parameters(self) -> dict[str, nn.Parameter]:
        _give_later_siblings_a_child(self)
        kept: dict[str, nn.Parameter] = self.__dict__["kept_parameters"]
        return kept

    @_parameters.setter
    def _parameters(self, value: dict[str, nn.Parameter]) -> None:
        self.__dict__["kept_parameters"] = value


@pytest.mark.parametrize("kind", [_ChangesSiblingsInGetattribute, _ChangesSiblingsInGetattr, _ChangesSiblingsInParameters])
def test_python_code_run_by_a_lookup_is_seen_by_every_later_child(kind: type[nn.Module]) -> None:
    """A wide module's children are walked one after another, as ``named_modules`` does, even
    where the walk looks ahead of them: what the lookup of one child's ``_modules`` or
    ``_parameters`` changes (here: every later sibling's ``_modules``) is what the walk meets."""
    siblings = nn.ModuleList(nn.Sequential(nn.ReLU()) for _ in range(40))
    # The first instance changes nothing: the walk has met the class before the second changes.
    unchanging, changer = kind(), kind()
    for module in (unchanging, changer):
        if kind is _ChangesSiblingsInGetattr:
            module.__dict__["kept_modules"] = module.__dict__.pop("_modules")
    changer.__dict__["siblings"] = siblings
    siblings.insert(1, unchanging)
    siblings.insert(4, changer)
    model = nn.ModuleDict({"layer": siblings})
    walked = PatternSet([]).walk(model, prune=False, parameters=kind is _ChangesSiblingsInParameters)
    expected = [name for name, _ in model.named_modules(remove_duplicate=False)]
    assert "layer.41.extra" in expected and "layer.3.extra" not in expected
    assert walked.names() == expected


def test_none_children_are_skipped_like_named_modules() -> None:
    model = nn.Module()
    model.register_module("empty", None)
    model.real = nn.ReLU()
    assert PatternSet(["*"]).walk(model).names() == ["real"]


@pytest.mark.parametrize("prune", [True, False])
@pytest.mark.parametrize(
    ("name", "error", "message"),
    [(7, TypeError, "module 'block' has a child whose name is not a str"), ("\ud800", ValueError, "is not valid UTF-8")],
)
def test_a_child_name_that_is_no_fqn_segment_is_named(name: object, error: type[Exception], message: str, prune: bool) -> None:
    model = nn.Module()
    model.block = nn.Module()
    model.block._modules[name] = nn.ReLU()  # type: ignore[index]
    with pytest.raises(error, match=message):
        PatternSet(["block.*"]).walk(model, prune=prune)


class AddsASibling(nn.Module):
    """Reading its ``_modules`` (as the walk does, through getattr) adds a module beside it."""

    def __getattribute__(self, name: str) -> Any:
        parent = object.__getattribute__(self, "__dict__").get("parent")
        if name == "_modules" and parent is not None and "added" not in parent._modules:
            parent._modules["added"] = nn.ReLU()
        return super().__getattribute__(name)


@pytest.mark.parametrize("prune", [True, False])
def test_children_that_change_during_the_walk_are_an_error(prune: bool) -> None:
    model = nn.Module()
    model.block = nn.Module()
    model.block.first = AddsASibling()
    model.block.last = nn.ReLU()
    model.block.first.__dict__["parent"] = model.block
    with pytest.raises(RuntimeError, match="the children of 'block' changed during the walk"):
        PatternSet(["block.**"]).walk(model, prune=prune)


@pytest.mark.parametrize("root", [None, 3, "model", torch.zeros(2)])
def test_non_module_roots_are_type_errors(root: object) -> None:
    with pytest.raises(TypeError, match=r"expected an nn\.Module"):
        PatternSet(["*"]).walk(root)


def test_a_deep_tree_does_not_overflow() -> None:
    root = node = nn.Sequential()
    for _ in range(5000):
        child = nn.Sequential()
        node.append(child)
        node = child
    tree = PatternSet(["**.0"]).walk(root)
    assert len(tree) == 5000


def test_did_you_mean_names_the_nearest_fqns(moe: nn.Module) -> None:
    tree = PatternSet([]).walk(moe, prune=False)
    assert tree.nearest("layers.*.mlp.expertz.*.down_proj", 3) == [
        "layers.0.mlp.experts.0.down_proj",
        "layers.0.mlp.experts.1.down_proj",
        "layers.0.mlp.experts.2.down_proj",
    ]
    assert tree.nearest("lm_haed", 1) == ["lm_head"]
    # Asking for more names than there are returns every name near enough to be meant, nearest
    # first; the root '' and names far from the pattern are left out.
    every = tree.nearest("lm_haed", 2**40)
    assert every[0] == "lm_head" and "" not in every and every == tree.nearest("lm_haed", len(every))
    assert tree.nearest("zzz", 2**40) == []


def _optimal_string_alignment(a: str, b: str) -> int:
    rows = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[len(a)][len(b)]


@settings(max_examples=300, deadline=None)
@given(
    names=st.lists(st.text("ab_", min_size=1, max_size=6), min_size=1, max_size=12, unique=True),
    pattern=st.text("ab_", min_size=1, max_size=6),
    count=st.integers(1, 4),
)
def test_did_you_mean_offers_the_nearest_names_within_half_the_cost_of_writing_them_anew(
    names: list[str], pattern: str, count: int
) -> None:
    """One-segment names and a literal pattern: the cost is the edit distance (swaps count once)."""
    costs = [(_optimal_string_alignment(pattern, name), index) for index, name in enumerate(names)]
    near = sorted((cost, index) for cost, index in costs if 2 * cost <= max(len(pattern), len(names[index])))
    expected = [names[index] for _, index in near[:count]]
    assert PatternSet([]).index_names(names, prune=False).nearest(pattern, count) == expected


def test_indices_outside_the_tree_are_value_errors() -> None:
    tree = PatternSet(["*"]).walk(nn.Sequential(nn.ReLU()), prune=False)
    for method, message in (
        (tree.names, "no name with index 9"),
        (tree.module_fqns, "no module with index 9"),
        (tree.modules, "no module with index 9"),
    ):
        with pytest.raises(ValueError, match=message):
            method([9])


def _parameter_reference(model: nn.Module, patterns: list[str]) -> list[tuple[str, list[int]]]:
    found = [
        (name, [i for i, p in enumerate(patterns) if reference_match(p, name)])
        for name, _ in model.named_parameters(remove_duplicate=False)
    ]
    return [(name, hits) for name, hits in found if hits]


def test_parameters_are_matched_in_the_same_walk_pruned_or_not(moe: nn.Module) -> None:
    patterns = ["layers.*.mlp.experts.*.gate_proj.weight", "**.bias", "layers.1.**", "embed_tokens.weight", "nothing.weight"]
    full = PatternSet(patterns).walk(moe, prune=False, parameters=True)
    assert full.parameter_names() == [name for name, _ in moe.named_parameters(remove_duplicate=False)]
    expected = _parameter_reference(moe, patterns)
    assert full.parameter_matches() == expected
    pruned = PatternSet(patterns).walk(moe, parameters=True)
    assert pruned.parameter_matches() == expected
    assert pruned.parameter_names() == [name for name, _ in expected]
    # Modules are matched as before, beside the parameters.
    assert pruned.matches() == PatternSet(patterns).walk(moe).matches()
    assert PatternSet(patterns).walk(moe).parameter_names() == []  # not asked for


def test_shared_parameters_and_modules_are_met_under_every_fqn() -> None:
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    model.b.register_parameter("extra", shared.weight)  # type: ignore[union-attr]
    tree = PatternSet(["**.{weight,extra}"]).walk(model, parameters=True)
    expected = [name for name, _ in model.named_parameters(remove_duplicate=False) if not name.endswith("bias")]
    assert [name for name, _ in tree.parameter_matches()] == expected == ["a.0.weight", "b.extra", "b.0.weight"]
    assert PatternSet(["**"]).walk(model, prune=False, parameters=True).nearest_parameters("a.0.wieght", 1) == ["a.0.weight"]


def _kinds_by_reference(parameters: list[torch.Tensor]) -> list[int]:
    kinds: dict[tuple[Any, ...], int] = {}
    return [kinds.setdefault((tuple(p.shape), p.dtype, p.requires_grad), len(kinds)) for p in parameters]


def test_named_parameters_are_torchs_with_their_kinds() -> None:
    shared = nn.Linear(2, 3)
    model = nn.ModuleDict(
        {
            "a": nn.Sequential(shared, nn.Linear(3, 3)),
            "b": nn.Sequential(shared, nn.Linear(2, 3).to(torch.float16)),
            "c": nn.Linear(3, 3, bias=False),
        }
    )
    model.b.register_parameter("tied", shared.weight)  # type: ignore[union-attr]
    model.c.weight.requires_grad_(False)  # type: ignore[union-attr]
    model.register_parameter("none", None)
    named = PatternSet([]).walk(model, prune=False, parameters=True).named_parameters()
    fqns, kinds, samples = named.fqns, named.kinds, named.samples
    expected = list(model.named_parameters())
    assert fqns == [name for name, _ in expected]
    assert kinds == _kinds_by_reference([p for _, p in expected])
    first: dict[int, torch.Tensor] = {}
    for kind, (_, parameter) in zip(kinds, expected, strict=True):
        first.setdefault(kind, parameter)
    assert len(samples) == len(first) and all(samples[kind] is p for kind, p in first.items())
    # a.0 and b.0 share one Linear; a.1 and c.weight differ in requires_grad only; b.1 in dtype only.
    assert len(set(kinds)) == len(samples) == 6


def test_named_parameters_of_a_deep_moe_tree(moe: nn.Module) -> None:
    named = PatternSet([]).walk(moe, prune=False, parameters=True).named_parameters()
    fqns, kinds, samples = named.fqns, named.kinds, named.samples
    expected = list(moe.named_parameters())
    assert fqns == [name for name, _ in expected]
    assert kinds == _kinds_by_reference([p for _, p in expected])
    assert all(samples[kind].shape == p.shape for kind, (_, p) in zip(kinds, expected, strict=True))


@pytest.mark.parametrize(
    "walk",
    [
        lambda ps, model: ps.walk(model, prune=False),
        lambda ps, model: ps.walk(model, parameters=True),
        lambda ps, model: ps.index_names(["a", "a.weight"], prune=False),
    ],
    ids=["parameters-not-read", "pruned", "offline"],
)
def test_named_parameters_need_a_full_walk_that_read_them(walk: Any) -> None:
    with pytest.raises(ValueError, match="full walk that read the parameters"):
        walk(PatternSet(["**"]), nn.Linear(2, 2)).named_parameters()


def test_a_parameter_that_is_no_tensor_is_named() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    model[0]._parameters["odd"] = object()  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"parameter '0\.odd' is not a tensor"):
        PatternSet([]).walk(model, prune=False, parameters=True).named_parameters()
