"""The error family: every meshbind error is a MeshbindError with a code, and the builtin a torch
user would catch for it."""

from __future__ import annotations

import pytest
from torch import nn

import meshbind
from meshbind import (
    BindingError,
    BindingRefusedError,
    CheckpointError,
    LayoutContext,
    LayoutError,
    MaterializationError,
    MeshbindError,
    PatternError,
    PatternSet,
    PlanError,
    PlanProblem,
    ProblemCode,
    StepMemoryError,
    describe_problem_codes,
    resolve_plan,
    validate_materialized_modules,
)


@pytest.mark.parametrize(
    ("error", "builtin", "code"),
    [
        (PatternError, ValueError, "pattern"),
        (PlanError, ValueError, "plan"),
        (BindingRefusedError, ValueError, None),
        (BindingError, RuntimeError, "bind_parallel"),
        (MaterializationError, ValueError, "materialization"),
        (LayoutError, ValueError, "layout"),
        (CheckpointError, ValueError, "checkpoint"),
        (StepMemoryError, RuntimeError, "step_memory"),
    ],
)
def test_each_error_is_a_meshbind_error_and_its_builtin(
    error: type[Exception], builtin: type[Exception], code: str | None
) -> None:
    assert issubclass(error, MeshbindError) and issubclass(error, builtin)
    if code is not None:
        assert error.code == code  # type: ignore[attr-defined]


def test_a_malformed_pattern_raises_the_family_error_from_rust() -> None:
    with pytest.raises(MeshbindError) as caught:
        PatternSet(["layers.{a,b"])
    error = caught.value
    assert isinstance(error, PatternError) and isinstance(error, ValueError) and error.code == "pattern"
    assert (error.pattern, error.position) == ("layers.{a,b", 7) and "never closed" in error.reason


def test_a_plan_error_carries_its_code_and_every_problem_its_own() -> None:
    with pytest.raises(MeshbindError) as caught:
        request = meshbind.NativeParallelBindingRequest(("c",), meshbind.ParallelModuleSpec("p"), _none)
        resolve_plan(["a", "b"], [request], CONTEXT)
    error = caught.value
    assert isinstance(error, PlanError) and error.code == "plan" and [p.code for p in error.problems] == ["unmatched"]


def test_a_model_with_no_recorded_plan_is_refused_with_a_code() -> None:
    with pytest.raises(BindingRefusedError, match="no plan is recorded") as caught:
        validate_materialized_modules(nn.Linear(2, 2))
    assert caught.value.code == "unbound" and isinstance(caught.value, ValueError)


def test_all_lists_entry_points_and_the_returned_types_stay_importable() -> None:
    assert "ModuleTree" not in meshbind.__all__ and "IndexMatches" not in meshbind.__all__
    assert "ParallelPlan" not in meshbind.__all__ and "PlanProblem" not in meshbind.__all__
    assert meshbind.ModuleTree is meshbind._core.ModuleTree and meshbind.IndexMatches is meshbind._core.IndexMatches
    assert all(hasattr(meshbind, name) for name in meshbind.__all__)


CONTEXT = LayoutContext({"tp": 1})


def _none(module: object, fqn: str, context: LayoutContext) -> meshbind.ModuleShardingSpec:
    return meshbind.ModuleShardingSpec()


def test_problem_codes_are_one_enum_that_covers_every_code_the_package_raises() -> None:
    """Every code used in the package (Python ``ProblemCode.X``, Rust ``ProblemCode::X => "text"``)
    is a member; every member is raised somewhere; no problem is made from a bare string; the
    README lists each code with its line."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    python = "\n".join(path.read_text() for path in (root / "python" / "meshbind").rglob("*.py"))
    rust_texts = set(re.findall(r'ProblemCode::\w+ => "(\w+)"', (root / "rust" / "checks.rs").read_text()))
    used = {ProblemCode[name] for name in re.findall(r"ProblemCode\.([A-Z]+)\b", python)}
    assert rust_texts <= {code.value for code in ProblemCode} and rust_texts
    assert used | {ProblemCode(text) for text in rust_texts} == set(ProblemCode)
    assert not re.search(r'PlanProblem\("', python)
    with pytest.raises(ValueError, match="'layot' is not a valid ProblemCode"):
        PlanProblem("layot", "x", None, "a typo in a code")  # type: ignore[arg-type]
    readme = (root / "README.md").read_text()
    for code, line in describe_problem_codes().items():
        assert f"| `{code}` | {line} |" in readme
    problem = PlanProblem("layout", "x", None, "m")  # type: ignore[arg-type]
    assert problem.code is ProblemCode.LAYOUT and problem.code == "layout" and f"{problem.code:<9}|" == "layout   |"
