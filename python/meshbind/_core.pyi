"""Type stubs of the Rust extension (rust/python.rs)."""

from collections.abc import Sequence
from typing import Any, ClassVar, final

from typing_extensions import Self

from meshbind.errors import ProblemCode

__all__ = [
    "IndexMatches",
    "ModuleTree",
    "NamedParameters",
    "PatternSet",
    "PlacementKind",
    "PlacementProblem",
    "PlacementTable",
    "SelectedModules",
    "_hand_pruned_walk",
    "_layout_self_check",
    "_walk_count",
    "check_patterns",
    "index_groups",
    "layout_reads",
    "modules_lacking",
    "not_divisible",
    "same_object_groups",
    "split_dim",
]

# Malformed patterns raise meshbind.errors.PatternError (a MeshbindError and a ValueError).

@final
class PatternSet:
    """FQN patterns compiled once and answered together."""

    def __new__(cls, patterns: Sequence[str]) -> Self: ...
    @property
    def patterns(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def match(self, name: str) -> list[int]:
        """The ascending indices of the patterns matching ``name``."""
    def match_many(self, names: Sequence[str]) -> list[list[int]]:
        """``match`` for every name, in one call."""
    def walk(self, root: object, *, prune: bool = True, modules: bool = False, parameters: bool = False) -> ModuleTree:
        """Walk an ``nn.Module`` tree through ``_modules``, matching every FQN (aliases included).

        With ``prune`` only matching FQNs are recorded (and, with ``modules``, their modules and
        classes) and no subtree that no pattern can reach is entered; without it, everything is.
        With ``parameters``, each entered module's ``_parameters`` are matched as FQNs too."""
    def index_names(self, names: Sequence[str], *, prune: bool = True) -> ModuleTree:
        """Match a plain sequence of FQNs (the offline form of ``walk``), each name its own module.

        With ``prune`` only matching FQNs are recorded; without it, every one is."""
    def match_tree(self, tree: ModuleTree) -> ModuleTree:
        """This set's matches over a tree that recorded every FQN (``walk(root, prune=False)`` or
        ``index_names(names, prune=False)``), without walking the model again: the same modules,
        classes and parameters, this set's hits. ``ValueError`` for a pruned tree."""
    def match_indices(self, names: Sequence[str]) -> IndexMatches:
        """The compact form of ``match_many``, for names by the million: flat index arrays.

        A list of at least 2**17 ASCII names is matched on a thread per core (at most eight)."""

@final
class IndexMatches:
    """What ``PatternSet.match_indices`` found: one ``(name, pattern)`` pair per match."""

    def __len__(self) -> int: ...
    def matched_names(self) -> int:
        """How many names matched at least one pattern."""
    @property
    def names(self) -> memoryview:
        """The position of the name of every match in the given sequence (``uint32``), ascending."""
    @property
    def patterns(self) -> memoryview:
        """The pattern of every match (``uint32``), ascending within each name."""
    @property
    def counts(self) -> list[int]:
        """How many names each pattern matched: a 0 is a pattern that selects nothing."""

@final
class ModuleTree:
    """What a walk saw: every FQN, the module and class behind it, and every match."""

    def __len__(self) -> int: ...
    @property
    def module_count(self) -> int: ...
    @property
    def complete(self) -> bool: ...
    @property
    def may_share_matches(self) -> bool:
        """Whether a module this pruned walk kept (``modules=True``), or one it entered on the way,
        may have an alias the walk did not visit: when met, something besides its parent's
        ``_modules`` held it."""
    def names(self, indices: Sequence[int] | None = None) -> list[str]: ...
    def name_modules(self) -> list[int]: ...
    def module_names(self) -> list[str]:
        """Every module's first FQN, in tree order (a ``test-hooks`` build's only)."""
    def module_fqns(self, indices: Sequence[int]) -> list[str]: ...
    def modules(self, indices: Sequence[int]) -> list[object]: ...
    def named_parameters(self) -> NamedParameters:
        """Each parameter once, under its first FQN, in ``named_parameters()`` order (a full walk
        with ``parameters=True``)."""
    def classes(self) -> list[type]: ...
    def module_classes(self) -> list[int]: ...
    def modules_of_classes(self, classes: Sequence[int]) -> list[int]: ...
    def hits(self) -> tuple[list[int], list[int]]:
        """Every match as name and pattern indices (a ``test-hooks`` build's only)."""
    def matches(self) -> list[tuple[str, list[int]]]: ...
    def selected(self, request_patterns: Sequence[int], override_patterns: Sequence[int]) -> SelectedModules:
        """One row per module a request or an override selects, in tree order. Pattern ``i``
        belongs to request ``request_patterns[i]``, pattern ``len(request_patterns) + k`` to
        override ``override_patterns[k]``."""
    def matched_names(self) -> int: ...
    def hit_counts(self) -> list[int]: ...
    def cycles(self) -> list[tuple[str, str]]: ...
    def parameter_hit_counts(self) -> list[int]:
        """How many parameters each pattern matched (a walk with ``parameters=True``)."""
    def parameter_names(self) -> list[str]:
        """The parameter FQNs met (a walk with ``parameters=True``; pruned: the matching ones)."""
    def parameter_matches(self) -> list[tuple[str, list[int]]]:
        """``(parameter FQN, [pattern indices])`` for every matched parameter, in walk order."""
    def nearest_parameters(self, pattern: str, count: int = 3) -> list[str]:
        """The parameter FQNs met nearest to ``pattern`` ("did you mean" among parameters; a
        ``test-hooks`` build's only)."""
    def nearest(self, pattern: str, count: int = 3) -> list[str]: ...

@final
class SelectedModules:
    """The modules a plan's requests and overrides select (``ModuleTree.selected``), one row each
    in tree order; ``modules`` and ``classes`` are empty offline."""

    @property
    def module_indices(self) -> list[int]: ...
    @property
    def fqns(self) -> list[str]: ...
    @property
    def modules(self) -> list[Any]: ...
    @property
    def classes(self) -> list[type]: ...
    @property
    def first_request(self) -> list[int | None]:
        """The first request selecting each row (``None``: only overrides do)."""
    @property
    def other_requests(self) -> list[tuple[int, list[int]]]:
        """``(row, requests)``: the rows other requests select too."""
    @property
    def overrides(self) -> list[tuple[int, list[int]]]:
        """``(row, overrides)``: the rows overrides select."""

@final
class NamedParameters:
    """Each parameter once, under its first FQN, in ``named_parameters()`` order: parameters of
    one kind share shape, dtype, device type and ``requires_grad``, and ``samples[k]`` is the
    first of kind ``k``."""

    @property
    def fqns(self) -> list[str]: ...
    @property
    def kinds(self) -> list[int]: ...
    @property
    def samples(self) -> list[Any]: ...
    @property
    def ties(self) -> list[tuple[str, str]]:
        """``(later FQN, first FQN)`` for each FQN ``named_parameters(remove_duplicate=False)``
        gives a parameter met under an earlier one (a tie, or a shared module's alias)."""

@final
class PlacementKind:
    """torch's placement kinds, as ``PlacementTable.row`` takes them."""

    SHARD: ClassVar[PlacementKind]
    REPLICATE: ClassVar[PlacementKind]
    PARTIAL: ClassVar[PlacementKind]
    def __eq__(self, value: object, /) -> bool: ...
    def __int__(self) -> int: ...

@final
class PlacementProblem:
    """A problem ``PlacementTable.check`` found: the unit it is about, its code and its message."""

    @property
    def unit(self) -> int: ...
    @property
    def code(self) -> ProblemCode:
        """``ProblemCode.LAYOUT`` or ``ProblemCode.EXPERT``."""
    @property
    def message(self) -> str: ...

@final
class PlacementTable:
    """The placement rows of the ``layout`` checks and the expert rule for a whole plan, checked at once.

    Axes and labels are interned; each unit stands for modules whose checks give one answer."""

    def __new__(cls, axis_sizes: Sequence[tuple[str, int]], expert_axis: str) -> Self:
        """A table over the context's axes, ``expert_axis`` the one splitting the experts (rule 5);
        a size below 1 is a ``ValueError``."""
    def axis(self, name: str) -> int:
        """The id of an axis (added without a size, as one the context lacks, when new)."""
    def label(self, text: str, is_param: bool) -> int:
        """The id of a label (``params['w']``, ``in_src``…), added when new."""
    def unit(self, num_experts: int | None = None) -> int:
        """A new unit, with its ``num_experts`` (at least 1) when it is an ``ep`` unit."""
    def row(
        self,
        unit: int,
        label: int,
        axis: int,
        kind: PlacementKind,
        dim: int = 0,
        rank: int | None = None,
        first_dim: int | None = None,
        dim_size: int | None = None,
    ) -> None:
        """One named placement of a unit; ``rank``, ``first_dim`` and (for ``Shard(dim)``) ``dim_size``
        where the parameter's shape is known."""
    def check(self) -> list[PlacementProblem]:
        """Every ``layout`` problem (an axis the context lacks, ``Shard(d)``
        beyond the rank or over a dimension its axes do not divide, ``Partial`` on a parameter) and
        each unit's first ``expert`` problem."""

def split_dim(dim: int, rank: int) -> int | None:
    """The dimension ``Shard(dim)`` splits in a tensor of rank ``rank``, from 0 (``Shard(-1)`` of a
    matrix is 1); ``None`` when the tensor has no such dimension."""

def not_divisible(what: str, count: int, axis: str, size: int) -> str | None:
    """Why ``count`` (called ``what``) cannot be split evenly over the ``size`` ranks of ``axis``,
    or ``None`` when it can."""

def check_patterns(patterns: Sequence[str]) -> None:
    """Parse every pattern without building a set; raises ``PatternError`` for the first malformed one."""

def index_groups(fqns: Sequence[str], kinds: Sequence[int]) -> list[tuple[str, list[int]]]:
    """``(written FQN, member indices)`` for entries ``(fqns[i], kinds[i])`` whose FQNs differ in one
    numeric segment only (``layers.<0-47>.mlp``), in the order of each group's first entry."""

def same_object_groups(columns: Sequence[list[Any]]) -> list[list[int]]:
    """The rows grouped by the identity of their item in every list of ``columns`` (the lists of one
    length), each group ascending, the groups in the order of their first row."""

def modules_lacking(modules: list[Any], path: str, rows: Sequence[int] | None = None) -> list[int]:
    """The positions in ``rows`` (every index when ``None``) of the modules of the list whose
    ``_parameters`` has no key ``path``."""

def layout_reads() -> str:
    """``"on"`` when meshbind reads CPython's object layout in place, else ``"off: <why>"``
    (``MESHBIND_NO_LAYOUT_READS`` set, an interpreter whose layout is not known, a failed self-check)."""

def _layout_self_check(field: str | None) -> str | None:
    """For the tests: the self-check with one offset moved by a word; what it found wrong, or ``None``.
    Only in a build with the ``test-hooks`` feature (the test command's), never in a wheel."""

def _walk_count() -> int:
    """For the tests: how many module trees this process has walked (``PatternSet.walk`` calls).
    Only in a build with the ``test-hooks`` feature."""

def _hand_pruned_walk(root: object, patterns: Sequence[str]) -> int:
    """For the benchmarks: how many modules under ``root`` the ``patterns`` (literal segments and
    ``*``) name, walked by hand into only the modules a pattern continues below. Only in a build
    with the ``test-hooks`` feature."""
