"""SPEC §8 on real process groups: 2- and 4-rank gloo worlds with tp and ep axes, every check on
every rank (see layout_checks.py)."""

from __future__ import annotations

import pytest

from rank_checks import failures_of, world_results_fixture

WORLDS = {
    "2 ranks tp2 ep2": (2, {"dp": 1, "cp": 1, "tp": 2, "ep": 2}),
    "4 ranks cp2 tp2 ep4": (4, {"dp": 1, "cp": 2, "tp": 2, "ep": 4}),
}
CHECKS = ("meta", "values", "all_or_nothing", "family")


world_results = world_results_fixture(WORLDS, "layout_checks:run_checks")


@pytest.mark.parametrize("check", CHECKS)
def test_check_passes_on_every_rank(world_results: list[dict[str, str | None]], check: str) -> None:
    failures = failures_of(world_results, check)
    assert not failures, failures
