"""Running named checks on every rank of a local world, and reading their results in pytest."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch.distributed as dist

from meshbind.launch import run_local_world

Results = dict[str, str | None]
"""Check name → ``None`` when it passed on this rank, else its traceback."""


def process_group_count() -> int:
    """How many process groups exist now (the default one included): what "creates no group" counts."""
    return len(dist.distributed_c10d._world.pg_map)


def attempt_each(checks: Mapping[str, Callable[[], None]]) -> Results:
    """Every check, in order, each failure caught as its traceback so the others still run."""
    results: Results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results


def failures_of(world_results: Sequence[Results], check: str) -> str:
    """The tracebacks of ``check`` on every rank where it failed (empty when it passed everywhere)."""
    failed = {rank: result[check] for rank, result in enumerate(world_results) if result[check] is not None}
    return "\n".join(f"rank {rank}:\n{trace}" for rank, trace in failed.items())


def world_results_fixture(worlds: Mapping[str, tuple[int, dict[str, int]]], target: str) -> Any:
    """A module-scoped fixture running ``target`` (``module:function`` of sizes) once per world."""

    @pytest.fixture(scope="module", params=list(worlds))
    def world_results(request: pytest.FixtureRequest) -> list[Results]:
        world_size, sizes = worlds[request.param]
        results: list[Results] = run_local_world(world_size, target, sizes)
        return results

    return world_results
