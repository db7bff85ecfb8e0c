"""The model index (``meshbind.model_index``): one full walk of a model, kept as data on the plan,
read by the FSDP units, the report, the ranks' agreement and step memory instead of walking again."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import meshbind._core as _core
from meshbind import LayoutContext, resolve_plan
from meshbind.model_index import ModelIndex, index_of

_WALKS = ("named_modules", "modules", "named_parameters", "parameters", "named_children", "children")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.again = self.blocks[1]  # a shared module: its parameters again under a second FQN
        self.frozen = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16), requires_grad=False)


def test_the_index_is_what_named_modules_and_named_parameters_give() -> None:
    model = Tied()
    index = ModelIndex.of(model)
    assert list(index.module_fqns) == [fqn for fqn, _ in model.named_modules()]
    assert list(index.module_classes) == [type(module) for _, module in model.named_modules()]
    assert [(fqn, kind.shape, kind.dtype, kind.requires_grad) for fqn, kind in index.parameters()] == [
        (fqn, tuple(p.shape), p.dtype, p.requires_grad) for fqn, p in model.named_parameters()
    ]
    every = list(model.named_parameters(remove_duplicate=False))
    first = {id(p): fqn for fqn, p in reversed(every)}
    assert dict(index.ties) == {fqn: first[id(p)] for fqn, p in every if first[id(p)] != fqn}
    assert dict(index.ties)["head.weight"] == "embed.weight" and dict(index.ties)["again.bias"] == "blocks.1.bias"
    assert index.module_lists == (("blocks", 3),) and index.layer_list() == "blocks"
    assert index.class_of("again") is nn.Linear and index.class_of("") is Tied


def test_the_index_holds_no_parameter_and_answers_for_its_own_model_only() -> None:
    model = Tied()
    weight = weakref.ref(model.blocks[0].weight)
    index = ModelIndex.of(model)
    assert index.is_of(model) and not index.is_of(Tied())
    assert index_of(model, index) is index and index_of(Tied(), index) is not index
    del model
    gc.collect()
    assert weight() is None and index.model() is None  # nothing the model held lives on in its index


def test_resolve_plan_keeps_the_index_it_walked_when_asked() -> None:
    model = Tied()
    before = _core._walk_count()
    plan = resolve_plan(model, [], LayoutContext({}), index=True)
    assert _core._walk_count() == before + 1
    assert plan.index is not None and plan.index.is_of(model)
    assert resolve_plan(model, [], LayoutContext({})).index is None  # a pruned walk keeps none
    with pytest.raises(TypeError, match="index must be a bool"):
        resolve_plan(model, [], LayoutContext({}), index="yes")  # type: ignore[arg-type]


@pytest.fixture
def model_walks(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """Every walk meshbind's own code makes of a module tree through ``nn.Module``'s iterators:
    ``(method, calling module)``."""
    walks: list[tuple[str, str]] = []
    for name in _WALKS:
        original = getattr(nn.Module, name)

        def counted(self: nn.Module, *args: Any, __original: Any = original, __name: str = name, **kwargs: Any) -> Any:
            import sys

            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("meshbind"):
                walks.append((__name, caller))
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(nn.Module, name, counted)
    yield walks


def test_one_check_with_report_and_memory_walks_the_model_once(
    model_walks: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``meshbind check --report --memory`` walks the model once (the resolution's Rust walk) and
    resolves once: the report and step memory read the plan's index, and each traced depth takes
    the plan of the modules it keeps. The only iterations of a module tree left to meshbind's code
    are the traced step's optimizer taking its parameters, as a training step does."""
    import meshbind.resolution as resolution
    from meshbind.cli import main

    resolutions = []
    resolve = resolution._resolve
    monkeypatch.setattr(resolution, "_resolve", lambda *args: resolutions.append(1) or resolve(*args))
    before = _core._walk_count()
    flags = ["--axis", "dp_shard=2", "--axis", "tp=2", "--axis", "cp=1", "--axis", "ep=2", "--report", "--device", "cpu"]
    memory = ["--memory", "--batch", "1", "--seq-len", "16"]
    model_and_plan = ["step_memory_checks:deep_demo", "meshbind.examples.moe_transformer:loss_head_request"]
    assert main(["check", *model_and_plan, *flags, *memory]) == 0
    out = capsys.readouterr().out
    assert "extrapolated (exact)" in out and "parameters (shape -> local shape per rank" in out
    assert _core._walk_count() - before == 1
    assert len(resolutions) == 1
    assert {caller for _, caller in model_walks} <= {"meshbind.memory.step"}, model_walks
    assert [name for name, _ in model_walks] == ["parameters"] * len(model_walks)


def test_a_hugging_face_check_walks_the_model_once(
    model_walks: list[tuple[str, str]], tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``check --hf-config --report``: the plan source reads its keys from the index of the one
    walk, the selection matches that walk again, and "did you mean" for a key that selects nothing
    (Qwen3-MoE's dense ``mlp.gate_proj`` rule) reads the index too."""
    import json

    from meshbind.cli import main

    from hf_models import MOE

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 4, **MOE}))
    before = _core._walk_count()
    argv = ["check", "--hf-config", str(config), "--axis", "tp=2", "--axis", "ep=2", "--report"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "model.layers.<0-1>.mlp.experts.gate_up_proj" in out
        and "key 'model.layers.*.mlp.gate_proj' (colwise) selects no module" in out
    )
    assert _core._walk_count() - before == 1
    assert model_walks == []


def test_a_pattern_set_matches_a_whole_walk_again_as_it_would_walk_the_model() -> None:
    """``PatternSet.match_tree``: the modules, parameters and matches a walk of the same patterns
    gives, from the names of one whole walk; a pruned walk, which lacks names, is refused."""
    model = Tied()
    whole = _core.PatternSet([]).walk(model, prune=False, parameters=True)
    patterns = _core.PatternSet(["blocks.*", "again", "**.weight", "head.*", "embed"])
    walked = patterns.walk(model, prune=False, parameters=True)
    again = patterns.match_tree(whole)
    assert again.matches() == walked.matches() and again.parameter_matches() == walked.parameter_matches()
    assert again.names() == walked.names() and again.name_modules() == walked.name_modules()
    assert again.modules(list(range(again.module_count))) == walked.modules(list(range(walked.module_count)))
    assert again.hit_counts() == walked.hit_counts() and again.parameter_hit_counts() == walked.parameter_hit_counts()
    with pytest.raises(ValueError, match="match_tree needs a tree that recorded every FQN"):
        patterns.match_tree(patterns.walk(model, prune=True))
