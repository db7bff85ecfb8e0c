"""Type stubs of the Rust extension (rust/python.rs)."""

from collections.abc import Sequence
from typing import Any, final

from typing_extensions import Self

__all__ = ["IndexMatches", "ModuleTree", "PatternError", "PatternSet", "check_patterns", "check_placements", "modules_lacking"]

class PatternError(ValueError):
    """A malformed FQN pattern, quoted with a caret under the offending character."""

    pattern: str
    position: int
    reason: str

@final
class PatternSet:
    """FQN patterns (SPEC §2) compiled once and answered together."""

    def __new__(cls, patterns: Sequence[str]) -> Self: ...
    @property
    def patterns(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def match(self, name: str) -> list[int]:
        """The ascending indices of the patterns matching ``name``."""
    def match_many(self, names: Sequence[str]) -> list[list[int]]:
        """``match`` for every name, in one call."""
    def walk(self, root: object, *, prune: bool = True, modules: bool = False) -> ModuleTree:
        """Walk an ``nn.Module`` tree through ``_modules``, matching every FQN (aliases included).

        With ``prune`` only matching FQNs are recorded (and, with ``modules``, their modules and
        classes) and no subtree that no pattern can reach is entered; without it, everything is."""
    def index_names(self, names: Sequence[str], *, prune: bool = True) -> ModuleTree:
        """Match a plain sequence of FQNs (the offline form of ``walk``), each name its own module.

        With ``prune`` only matching FQNs are recorded; without it, every one is."""
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
    def module_names(self) -> list[str]: ...
    def module_fqns(self, indices: Sequence[int]) -> list[str]: ...
    def modules(self, indices: Sequence[int]) -> list[object]: ...
    def classes(self) -> list[type]: ...
    def module_classes(self) -> list[int]: ...
    def modules_of_classes(self, classes: Sequence[int]) -> list[int]: ...
    def hits(self) -> tuple[list[int], list[int]]: ...
    def matches(self) -> list[tuple[str, list[int]]]: ...
    def owners(self, pattern_owner: Sequence[int | None]) -> tuple[list[int], list[int], list[tuple[int, int]]]: ...
    def matched_names(self) -> int: ...
    def hit_counts(self) -> list[int]: ...
    def cycles(self) -> list[tuple[str, str]]: ...
    def nearest(self, pattern: str, count: int = 3) -> list[str]: ...

def check_placements(
    axis_names: Sequence[str],
    axis_sizes: Sequence[int | None],
    labels: Sequence[str],
    label_is_param: Sequence[bool],
    row_module: Sequence[int],
    row_label: Sequence[int],
    row_axis: Sequence[int],
    row_kind: Sequence[int],
    row_dim: Sequence[int],
    row_rank: Sequence[int | None],
    row_first_dim: Sequence[int | None],
    num_experts: Sequence[int | None],
) -> list[tuple[int, str, str]]:
    """SPEC §4 ``layout`` and §5 rule 5 over every planned module at once (rows in any order)."""

def check_patterns(patterns: Sequence[str]) -> None:
    """Parse every pattern without building a set; raises ``PatternError`` for the first malformed one."""

def modules_lacking(modules: list[Any], path: str) -> list[int]:
    """The indices of the modules in the list whose ``_parameters`` has no key ``path``."""
