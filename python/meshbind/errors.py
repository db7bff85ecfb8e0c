"""meshbind's errors: one family under ``MeshbindError``, each error with a stable ``.code``.

Each is also the builtin a caller of torch would catch for it: a bad pattern, plan or request
is a ``ValueError``; a module's own ``bind_parallel`` failing is a ``RuntimeError``.

=====================  ==============  ==========================================================
error                  builtin         ``.code``
=====================  ==============  ==========================================================
PatternError           ValueError      ``pattern``
PlanError              ValueError      ``plan`` (each of its ``problems`` has a ``ProblemCode``)
BindingRefusedError    ValueError      ``owner``, ``class``, ``mesh``, ``module``, ``unbound``
LayoutError            ValueError      ``layout`` (``apply_layouts``: every problem in ``problems``)
CheckpointError        ValueError      ``checkpoint`` (every misfit key in ``problems``)
BindingError           RuntimeError    ``bind_parallel``
MaterializationError   ValueError      ``materialization``
RankMismatchError      RuntimeError    ``rank_mismatch``
StepMemoryError        RuntimeError    ``step_memory``
=====================  ==============  ==========================================================
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


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


class ProblemCode(str, Enum):
    """Every code a ``PlanProblem`` carries; ``describe_problem_codes()`` gives one
    line on each. A problem made with any other code is a ``ValueError``."""

    UNMATCHED = "unmatched"
    CONFLICT = "conflict"
    NESTED = "nested"
    LAYOUT = "layout"
    STAGE = "stage"
    BINDING = "binding"
    EXPERT = "expert"
    VALIDATOR = "validator"
    FSDP = "fsdp"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


_PROBLEM_CODE_LINES = {
    ProblemCode.UNMATCHED: "a pattern or key that selects nothing (with up to three 'did you mean')",
    ProblemCode.CONFLICT: "a module selected by two requests with different specs or layouts, or against its family's own spec",
    ProblemCode.NESTED: "a bound module inside another bound module of the same binding kind",
    ProblemCode.LAYOUT: "a layout provider or override failure, an axis the context lacks, a shard dimension beyond the rank "
    "or not divisible by its axes, a config fact an axis does not divide, a tie placed two ways",
    ProblemCode.STAGE: "a stage the class lacks or that refuses its keywords; in_src/in_dst or out_src/out_dst that differ",
    ProblemCode.BINDING: "a binding kind without bind_parallel(binding), or a family class without a valid parallel_spec",
    ProblemCode.EXPERT: "num_experts no int, below 1 or not divisible by ep; expert weights not Shard(0) over the experts",
    ProblemCode.VALIDATOR: "the spec's own validate(module=, sharding=, context=) raised or returned something",
    ProblemCode.FSDP: "an FSDP unit torch's fully_shard cannot take: a container, parameters of both meshes or of two "
    "dtypes, a tie across units, a 0-d parameter, or a parameter already placed on an axis FSDP shards over",
}


def describe_problem_codes() -> dict[str, str]:
    """Every problem code with one line on what it means, in ``ProblemCode`` order."""
    return {code.value: _PROBLEM_CODE_LINES[code] for code in ProblemCode}


@dataclass(frozen=True)
class PlanProblem:
    """One problem: its code, the FQN it concerns, the request, why. A problem of no one
    module says what it is about instead: ``pattern``, ``key`` (of a transformers plan), ``class``
    (a family class) or ``axes`` (an axis the plan cannot use)."""

    code: ProblemCode
    fqn: str | None
    request: str | None
    message: str
    about: str = "module"

    def __post_init__(self) -> None:
        object.__setattr__(self, "code", ProblemCode(self.code))  # a code outside the enum is a ValueError

    def line(self) -> str:
        where = f"({self.about})" if self.fqn is None else repr(self.fqn)
        source = f" [{self.request}]" if self.request else ""
        return f"{self.code:<9} {where}: {self.message}{source}"

    def to_dict(self) -> dict[str, str | None]:
        """JSON-ready."""
        return {"code": self.code.value, "fqn": self.fqn, "about": self.about, "request": self.request, "message": self.message}


class LayoutRefusal(MeshbindError, ValueError):
    """Raised by a layout provider that refuses a module for a reason it states itself (a config
    fact the axes do not divide): the ``layout`` problem shows the message as it is."""

    code = "layout"


class PlanError(MeshbindError, ValueError):
    """Every problem of a plan; ``problems`` holds them as ``PlanProblem``, one per module, sorted
    by FQN with numbers in numeric order (``layers.2`` before ``layers.10``). The text shows
    problems that differ only in one index of their FQN as one line (``12 modules
    'layers.<0-11>.mlp': ...``)."""

    code = "plan"

    def __init__(self, problems: Sequence[PlanProblem]) -> None:
        self.problems = tuple(sorted(problems, key=lambda p: (p.fqn is not None, natural_key(p.fqn or ""), p.code)))
        count = len(self.problems)
        lines = "\n".join("  " + line for line in grouped_lines(self.problems))
        super().__init__(f"the plan has {count} problem{'s' if count != 1 else ''}:\n{lines}")


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """A sort key reading runs of digits as numbers: ``layers.2`` before ``layers.10``."""
    return tuple((0, int(run)) if run.isdigit() else (1, run) for run in re.findall(r"\d+|\D+", text))


def grouped_lines(problems: Sequence[PlanProblem]) -> list[str]:
    """One line per problem, but one line for the problems of the same code, request and message
    whose FQNs differ in a single numeric segment, that segment written as the indices' pattern
    (``<0-47>`` for a run, ``{0,2,7}`` otherwise). In the order of ``problems``."""
    lines: list[str] = []
    for fqn, members in index_groups([(p.fqn, (p.code, p.request, p.message)) for p in problems]):
        if len(members) == 1:
            lines.append(problems[members[0]].line())
            continue
        first = problems[members[0]]
        source = f" [{first.request}]" if first.request else ""
        lines.append(f"{first.code:<9} {len(members)} modules {fqn!r}: {first.message}{source}")
    return lines


def index_groups(entries: Sequence[tuple[str | None, object]]) -> list[tuple[str | None, list[int]]]:
    """``(fqn, what)`` entries grouped when ``what`` is equal and their FQNs differ in one numeric
    segment only, written as the indices' pattern (``<0-47>`` for a run, ``{0,2,7}`` otherwise):
    ``(written FQN, entry indices)``, in the order of first appearance (Rust). An entry without
    an FQN, and anything else, stays alone."""
    import meshbind._core as _core  # the extension raises these errors: it is imported here, not at the top

    kinds: dict[object, int] = {}
    codes = [kinds.setdefault(what, len(kinds)) if fqn is not None else -1 for fqn, what in entries]
    alone = len(kinds)
    for index, code in enumerate(codes):
        if code < 0:  # a kind of its own
            codes[index], alone = alone, alone + 1
    groups = _core.index_groups([fqn or "" for fqn, _ in entries], codes)
    return [(written if entries[members[0]][0] is not None else None, members) for written, members in groups]


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


class PipelineError(_ListedProblems):
    """The pipeline cannot be split or scheduled as asked, found before any stage is built;
    ``problems`` names each: the axis, the schedule, the stage and the module FQN concerned."""

    code = "pipeline"

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("cannot pipeline the model", "problem", problems)


class CheckpointError(_ListedProblems):
    """A checkpoint that does not fit the model; ``problems`` names every key (missing, or at
    another shape). Nothing was loaded. A refused save says so in its ``headline``."""

    code = "checkpoint"

    def __init__(
        self, problems: Sequence[str], headline: str = "the checkpoint does not fit the model", noun: str = "key"
    ) -> None:
        super().__init__(headline, noun, problems)


class BindingError(MeshbindError, RuntimeError):
    """A module's ``bind_parallel`` failed; ``fqn`` names it. Nothing stays bound."""

    code = "bind_parallel"

    def __init__(self, fqn: str, error: BaseException, restore_failures: list[str]) -> None:
        self.fqn = fqn
        restored = "every module bound by this call was restored"
        if restore_failures:
            restored += f", but unbind_parallel failed for {'; '.join(restore_failures)}"
        super().__init__(f"bind_parallel of {fqn!r} failed ({restored}): {type(error).__name__}: {error}")


class RankMismatchError(MeshbindError, RuntimeError):
    """The ranks of a world were about to do different things (another model, plan or mesh), or
    one did not arrive: raised on every rank before anything changed. ``what`` names the entry
    point, ``differences`` the ranks that differ and the first entry where each does."""

    code = "rank_mismatch"

    def __init__(self, what: str, differences: Sequence[str]) -> None:
        self.what, self.differences = what, tuple(differences)
        lines = "\n".join(f"  {line}" for line in self.differences)
        super().__init__(f"the ranks do not agree before {what}; nothing was changed:\n{lines}")


class MaterializationError(MeshbindError, ValueError):
    """Every failing ``validate_materialized``, as ``(fqn, error)`` in ``failures``."""

    code = "materialization"

    def __init__(self, failures: list[tuple[str, BaseException]]) -> None:
        self.failures = failures
        lines = "\n".join(f"  {fqn!r}: {type(error).__name__}: {error}" for fqn, error in failures)
        super().__init__(f"{len(failures)} module{'s' if len(failures) != 1 else ''} failed validate_materialized:\n{lines}")


class StepMemoryError(MeshbindError, RuntimeError):
    """A training step that cannot be traced (``step_memory``): the reason, and the module or
    setting that stops it. No figure is given."""

    code = "step_memory"


def did_you_mean(candidates: Sequence[str]) -> str:
    """The end of a message about a name that selects nothing: ``; did you mean 'a', 'b'?``, or
    nothing without candidates. Each candidate as the caller writes it (quoted, or saying what it is)."""
    return f"; did you mean {', '.join(candidates)}?" if candidates else ""
