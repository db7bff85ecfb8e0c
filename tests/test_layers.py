"""The layers of docs/design.md hold in the code: no module imports one of a higher layer, in
Python or in Rust, and neither side has an import cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "meshbind"

LAYERS: dict[str, int] = {
    # the vocabulary, the world, the specs and the Rust core
    "meshbind._core": 0,
    "meshbind.errors": 0,
    "meshbind.names": 0,
    "meshbind.units": 0,
    "meshbind.world": 0,
    "meshbind.routing": 0,
    "meshbind.specs": 0,
    "meshbind.fsdp_request": 0,
    "meshbind.placements": 0,
    "meshbind.modules": 0,
    "meshbind.model_index": 0,
    "meshbind.launch": 0,
    "meshbind.model_flops": 0,
    "meshbind.forks": 0,
    # the meshes and contexts a module binds to, and the per-module rules
    "meshbind.mesh": 1,
    "meshbind.cp": 1,
    "meshbind.ep": 1,
    "meshbind.family": 1,
    "meshbind.validation": 1,
    # the plan, resolved
    "meshbind.resolution": 2,
    # what applies a plan to a model, and where plans come from
    "meshbind.agreement": 3,
    "meshbind.layouts": 3,
    "meshbind.fsdp": 3,
    "meshbind.activation_checkpointing": 3,
    "meshbind.pipeline": 3,
    "meshbind.binding": 3,
    "meshbind.checkpoints": 3,
    "meshbind.interop": 3,
    "meshbind.appliers": 3,
    # what reads a resolved plan and an applied model
    "meshbind.report": 4,
    "meshbind.report_page": 4,
    "meshbind.search_page": 4,
    "meshbind.memory": 4,
    "meshbind.comms": 4,
    "meshbind.steptime": 4,
    "meshbind.search": 4,
    "meshbind.bench": 4,
    "meshbind.examples": 4,
    "meshbind.demo": 4,
    # the command line and the package's own names
    "meshbind.cli": 5,
    "meshbind": 5,
    "meshbind.__main__": 5,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    """The layer of the longest prefix of ``module`` that LAYERS names."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:end])) in LAYERS:
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/design.md")


def _python_imports() -> dict[str, set[str]]:
    """Each module of the package and the meshbind modules it imports, anywhere in its body."""
    imports: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("meshbind"))
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshbind") and not node.level:
                # ``from meshbind.demo import config`` names a module; ``from meshbind.x import f`` a name of x
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    found.add(candidate if _is_module(candidate) else node.module)
        imports[name] = found - {name}
    return imports


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists() or name == "meshbind._core"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == 1:
                return [*stack[stack.index(child) :], child]
            if child not in state and (found := visit(child)) is not None:
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_python_module_imports_a_higher_layer() -> None:
    upward = [
        f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
        for module, targets in _python_imports().items()
        for target in sorted(targets)
        if _layer(target) > _layer(module)
    ]
    assert upward == []


def test_python_modules_import_no_cycle() -> None:
    # the package's own __init__ names everything, lazily: it is no edge of a cycle
    graph = {module: {t for t in targets if t != "meshbind"} for module, targets in _python_imports().items()}
    graph.pop("meshbind", None)
    assert _cycle(graph) is None


def _rust_uses() -> dict[str, set[str]]:
    """Each Rust file (by module path) and the crate's files it uses: ``use crate::...``, and a
    folder's ``mod.rs`` using its own children. A child using its parent (``super::``) is part of
    the parent's module and no edge."""
    rust = ROOT / "rust"
    uses: dict[str, set[str]] = {}
    for path in sorted(rust.rglob("*.rs")):
        parts = path.relative_to(rust).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "mod" else parts)
        text = path.read_text(encoding="utf-8")
        found = {m.replace("::", ".") for m in re.findall(r"\buse crate::(\w+(?:::[a-z_]+)*)", text)}
        if parts[-1] == "mod":
            children = {child.stem for child in path.parent.glob("*.rs")} - {"mod"}
            found |= {f"{module}.{m}" for m in re.findall(r"\buse (?:self::)?([a-z_]+)::", text) if m in children}
        uses[module] = {_rust_module(name, rust) for name in found} - {module}
    return uses


def _rust_module(name: str, rust: Path) -> str:
    """The longest prefix of ``name`` that is a file of the crate."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = rust.joinpath(*parts[:end])
        if candidate.with_suffix(".rs").exists() or (candidate / "mod.rs").exists():
            return ".".join(parts[:end])
    return parts[0]


def test_rust_files_use_no_cycle() -> None:
    assert _cycle(_rust_uses()) is None


@pytest.mark.parametrize("graph", [{"a": {"b"}, "b": {"a"}}, {"a": {"b"}, "b": {"c"}, "c": {"a"}}])
def test_a_cycle_is_found(graph: dict[str, set[str]]) -> None:
    assert _cycle(graph) is not None and _cycle({"a": {"b"}, "b": set()}) is None


MAX_PYTHON_LINES = 350
MAX_BINDING_LINES = 450


def test_files_are_cut_by_job_to_a_readable_size() -> None:
    """No module of the package over 350 lines; no file of the Rust binding layer over 450."""
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for limit, paths in (
            (MAX_PYTHON_LINES, PACKAGE.rglob("*.py")),
            (MAX_BINDING_LINES, (ROOT / "rust" / "python").glob("*.rs")),
        )
        for path in paths
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > limit
    ]
    assert long == []
