"""meshbind's errors: one family under ``MeshbindError``, each error with a stable ``.code``.

Each is also the builtin a caller of torch would catch for it: a bad pattern, plan or request
is a ``ValueError``; a module's own ``bind_parallel`` failing is a ``RuntimeError``.

=====================  ==============  ==========================================================
error                  builtin         ``.code``
=====================  ==============  ==========================================================
PatternError           ValueError      ``pattern``
PlanError              ValueError      ``plan`` (each of its ``problems`` has a code of SPEC §4)
BindingRefusedError    ValueError      ``owner``, ``class``, ``mesh``, ``module``, ``unbound``
LayoutError            ValueError      ``layout`` (``apply_layouts``: every problem in ``problems``)
CheckpointError        ValueError      ``checkpoint`` (every misfit key in ``problems``)
BindingError           RuntimeError    ``bind_parallel``
MaterializationError   ValueError      ``materialization``
=====================  ==============  ==========================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class MeshbindError(Exception):
    """The base of every error meshbind raises for a plan, a pattern or a binding."""

    code: str = "meshbind"


class PatternError(MeshbindError, ValueError):
    """A malformed FQN pattern; ``pattern``, ``position`` (a character offset) and ``reason`` say
    what and where (set by the Rust compiler that raises it)."""

    code = "pattern"
    pattern: str
    position: int
    reason: str


@dataclass(frozen=True)
class PlanProblem:
    """One problem: its code (SPEC §4), the FQN it concerns (``None`` for a pattern), the request, why."""

    code: str
    fqn: str | None
    request: str | None
    message: str

    def line(self) -> str:
        where = "(pattern)" if self.fqn is None else repr(self.fqn)
        source = f" [{self.request}]" if self.request else ""
        return f"{self.code:<9} {where}: {self.message}{source}"


class PlanError(MeshbindError, ValueError):
    """Every problem of a plan, sorted by FQN; ``problems`` holds them as ``PlanProblem``."""

    code = "plan"

    def __init__(self, problems: Sequence[PlanProblem]) -> None:
        self.problems = tuple(sorted(problems, key=lambda p: (p.fqn is not None, p.fqn or "", p.code)))
        count = len(self.problems)
        lines = "\n".join("  " + p.line() for p in self.problems)
        super().__init__(f"the plan has {count} problem{'s' if count != 1 else ''}:\n{lines}")


class BindingRefusedError(MeshbindError, ValueError):
    """A binding refused before anything was bound: ``code`` says why (``owner``: the module has
    another communication owner; ``class``: its class cannot be bound with the spec; ``mesh``: the
    plan was resolved for other axis sizes, or names an axis the meshes lack; ``module``: the plan
    names a module the model does not have; ``unbound``: no plan is recorded on the model)."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


class _ListedProblems(MeshbindError, ValueError):
    """An error whose ``problems`` are lines of text, one per FQN or key, all shown."""

    def __init__(self, title: str, noun: str, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        count = len(self.problems)
        lines = "\n".join(f"  {problem}" for problem in self.problems)
        super().__init__(f"{title} ({count} {noun}{'s' if count != 1 else ''}):\n{lines}")


class LayoutError(_ListedProblems):
    """``apply_layouts`` refused the plan before any parameter changed; ``problems`` names each
    parameter FQN and what is wrong with it (an axis no mesh has, axes of both meshes, a tie
    given two layouts, a parameter distributed with another layout, one the model lacks)."""

    code = "layout"

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("cannot apply the layouts", "problem", problems)


class CheckpointError(_ListedProblems):
    """A checkpoint that does not fit the model; ``problems`` names every key (missing, or at
    another shape). Nothing was loaded."""

    code = "checkpoint"

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("the checkpoint does not fit the model", "key", problems)


class BindingError(MeshbindError, RuntimeError):
    """A module's ``bind_parallel`` failed; ``fqn`` names it. Nothing stays bound."""

    code = "bind_parallel"

    def __init__(self, fqn: str, error: BaseException, restore_failures: list[str]) -> None:
        self.fqn = fqn
        restored = "every module bound by this call was restored"
        if restore_failures:
            restored += f", but unbind_parallel failed for {'; '.join(restore_failures)}"
        super().__init__(f"bind_parallel of {fqn!r} failed ({restored}): {type(error).__name__}: {error}")


class MaterializationError(MeshbindError, ValueError):
    """Every failing ``validate_materialized``, as ``(fqn, error)`` in ``failures``."""

    code = "materialization"

    def __init__(self, failures: list[tuple[str, BaseException]]) -> None:
        self.failures = failures
        lines = "\n".join(f"  {fqn!r}: {type(error).__name__}: {error}" for fqn, error in failures)
        super().__init__(f"{len(failures)} module{'s' if len(failures) != 1 else ''} failed validate_materialized:\n{lines}")
