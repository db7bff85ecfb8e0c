"""SPEC §6 on real process groups: 2- and 4-rank gloo worlds, every check on every rank."""

from __future__ import annotations

import pytest

from meshbind import MeshContext
from meshbind.launch import run_local_world

from rank_checks import failures_of, world_results_fixture

WORLDS = {
    "2 ranks dp1 cp2 tp1 ep2": (2, {"dp": 1, "cp": 2, "tp": 1, "ep": 2}),
    "4 ranks cp4 tp1 ep4": (4, {"dp": 1, "cp": 4, "tp": 1, "ep": 4}),
}
CHECKS = (
    "mesh_sizes",
    "axis_mesh",
    "cp",
    "ep_random",
    "ep_skewed",
    "binding",
    "binding_all_or_nothing",
    "validate_materialized",
    "wrappers",
)


world_results = world_results_fixture(WORLDS, "distributed_checks:run_checks")


@pytest.mark.parametrize("check", CHECKS)
def test_check_passes_on_every_rank(world_results: list[dict[str, str | None]], check: str) -> None:
    failures = failures_of(world_results, check)
    assert not failures, failures


def test_a_rank_that_dies_fails_the_run_at_once_naming_it() -> None:
    # Without the check for dead ranks this waits out the deadline and reports "did not finish".
    died = r"rank 1 \(exit code 3\) of distributed_checks:exit_on_rank_one died without a result"
    with pytest.raises(RuntimeError, match=died):
        run_local_world(2, "distributed_checks:exit_on_rank_one")


def test_meshes_need_an_initialised_process_group() -> None:
    with pytest.raises(ValueError, match=r"MeshContext\.build needs an initialised process group"):
        MeshContext.build()
