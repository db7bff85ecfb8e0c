"""What a step-memory trace assumes where the data would decide: how many (token, choice) pairs
each expert-parallel rank receives. Routing is data-dependent and a fake tensor holds no data, so
the trace makes the counts concrete under a stated assumption instead.

The hook is ``assumed_routing()``: ``EPContext.dispatch`` reads it, and ``step_memory`` sets it
for the length of a trace. A model with its own expert dispatch reads it the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class Routing:
    """Balanced routing (``capacity_factor`` 1.0): every rank sends and receives an equal share of
    the pairs. Above 1.0, the traced rank receives that many times its share from every rank (an
    expert at its capacity), which bounds a rank whose experts are popular."""

    capacity_factor: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_factor, (int, float)) or not 1.0 <= self.capacity_factor <= 1e6:
            raise ValueError(f"the routing capacity factor must be a number from 1.0, got {self.capacity_factor!r}")

    def counts(self, pairs: int, ranks: int) -> tuple[list[int], list[int]]:
        """The pairs this rank sends to each rank and receives from each rank."""
        share, extra = divmod(pairs, ranks)
        send = [share + (1 if rank < extra else 0) for rank in range(ranks)]
        received = math.ceil(self.capacity_factor * pairs / ranks)
        return send, [received] * ranks

    def text(self) -> str:
        if self.capacity_factor == 1.0:
            return "balanced routing"
        return f"routing at capacity factor {self.capacity_factor:g}"


_ASSUMED: ContextVar[Routing | None] = ContextVar("meshbind_assumed_routing", default=None)


def assumed_routing() -> Routing | None:
    """The routing a trace assumes, or ``None`` when tokens are routed by their data."""
    return _ASSUMED.get()


@contextmanager
def assuming(routing: Routing) -> Iterator[None]:
    token = _ASSUMED.set(routing)
    try:
        yield
    finally:
        _ASSUMED.reset(token)
