"""Ranks agree before the first collective (SPEC §10): on real 2- and 4-rank gloo worlds, on real
weights and on meta, a last rank that builds another model, writes another pattern or placement,
or arrives late makes every rank raise RankMismatchError naming it, before anything changes."""

from __future__ import annotations

from pathlib import Path

import pytest
from rank_agreement_checks import scenarios

from meshbind.launch import run_local_world

EXPECTED = {
    "one more layer": "parameter layers.4.weight: (16, 16) float32 on {device} here, absent on rank 0",
    "another pattern": "plan layers.3: absent here, plain v1 weight={{tp: S(0)}} on rank 0",
    "another placement": "plan layers.2: plain v1 weight={{tp: S(1)}} here, plain v1 weight={{tp: S(0)}} on rank 0",
    "another shape": "parameter layers.1.weight: (32, 16) float32 on {device} here, (16, 16) float32 on {device} on rank 0",
    "a frozen weight": "parameter layers.1.weight: (16, 16) float32 on {device}, frozen here, (16, 16) float32 on {device} on",
    "another device": "parameter layers.0.weight: (16, 16) float32 on {other} here, (16, 16) float32 on {device} on rank 0",
    "another reshard_after_forward": "fsdp reshard_after_forward: False here, True on rank 0",
}


@pytest.fixture(scope="module", params=[(2, False), (2, True), (4, True)], ids=["2 ranks", "2 ranks on meta", "4 ranks on meta"])
def world(request: pytest.FixtureRequest) -> tuple[int, bool, list[dict[str, str | None]]]:
    size, meta = request.param
    return size, meta, run_local_world(size, "rank_agreement_checks:run_scenarios", meta, timeout=60)


@pytest.mark.parametrize("scenario", list(scenarios(False)))
def test_every_rank_refuses_a_divergence_naming_the_rank_and_entry(
    world: tuple[int, bool, list[dict[str, str | None]]], scenario: str
) -> None:
    size, meta, results = world
    devices = {"device": "meta" if meta else "cpu", "other": "cpu" if meta else "meta"}
    texts = [result[scenario] for result in results]
    if scenario == "the same":
        assert texts == [None] * size
        return
    for text in texts:
        assert text is not None and "CHANGED" not in text, text
        assert text.startswith("the ranks do not agree before apply_layouts; nothing was changed:")
        assert f"rank {size - 1} differs from rank 0 first at {EXPECTED[scenario].format(**devices)}" in text, text
    assert len(set(texts)) == 1  # every rank says the same


def test_a_rank_that_does_not_arrive_is_named_within_the_timeout(tmp_path: Path) -> None:
    written = tmp_path / "rank0.txt"
    with pytest.raises(RuntimeError):  # the group that timed out is closed: the world ends failed
        run_local_world(2, "rank_agreement_checks:one_rank_late", 8.0, str(written), timeout=60)
    text = written.read_text()
    assert text.startswith(("2.", "3.")), text  # seconds: the timeout, not the late rank's 8
    assert "not every rank arrived within 2 s" in text and "Ranks 1 failed to pass monitoredBarrier" in text, text


def test_the_switch_turns_the_check_off() -> None:
    # Off, a divergence on meta goes through unseen: the silent inconsistency the check exists for.
    assert run_local_world(2, "rank_agreement_checks:switched_off", timeout=60) == [None, None]


def test_every_entry_point_that_leads_to_collectives_checks_first() -> None:
    results = run_local_world(2, "rank_agreement_checks:other_entry_points", timeout=120)
    for what, first in {
        "parallelize_checked": "parameter layers.4.weight: (16, 16) float32 on meta here, absent on rank 0",
        "apply_hf_plan": "parameter model.layers.2.self_attn.q_proj.weight: (64, 64) float32 on cpu here, absent on rank 0",
        "save_checkpoint": "parameter layers.4.weight: (16, 16) float32 on cpu here, absent on rank 0",
        "load_checkpoint": "parameter layers.4.weight: (16, 16) float32 on cpu here, absent on rank 0",
    }.items():
        for result in results:
            assert result[what] == (
                f"the ranks do not agree before {what}; nothing was changed:\n  rank 1 differs from rank 0 first at {first}"
            ), result[what]


def test_an_agreement_is_remembered_until_what_the_ranks_do_changes() -> None:
    results = run_local_world(2, "rank_agreement_checks:remembered_agreement", timeout=60)
    assert results == [{"after layouts, binding and fsdp": 1, "after another plan": 2}] * 2


def test_a_rank_that_changed_between_steps_is_told_who_did_not_come() -> None:
    with pytest.raises(RuntimeError) as failed:
        run_local_world(2, "rank_agreement_checks:one_rank_changes_between_steps", timeout=8)
    text = str(failed.value)
    assert "rank 1:" in text and "the ranks do not agree before bind_parallel_modules" in text, text
    assert "not every rank arrived within 2 s" in text, text


@pytest.mark.parametrize("value", ["abc", "-5", "nan"])
def test_a_bad_timeout_is_refused_naming_the_variable_on_every_rank(value: str) -> None:
    results = run_local_world(2, "rank_agreement_checks:timeout_refused", value, timeout=60)
    assert results == [f"MESHBIND_RANK_CHECK_TIMEOUT={value!r} must be a positive number of seconds"] * 2


def test_a_refusal_on_ranks_is_one_message_naming_them_without_tracebacks() -> None:
    with pytest.raises(RuntimeError) as everywhere:
        run_local_world(2, "rank_agreement_checks:refused_on", [0, 1], timeout=60)
    assert str(everywhere.value) == (
        "every rank: CheckpointError: the checkpoint is damaged (1 problem):\n  'ckpt/__0_0.distcp': 16 bytes differ"
    )
    with pytest.raises(RuntimeError) as one:
        run_local_world(2, "rank_agreement_checks:refused_on", [1], timeout=60)
    assert str(one.value) == (
        "rank 1: CheckpointError: the checkpoint is damaged (1 problem):\n  'ckpt/__0_0.distcp': 16 bytes differ\n"
        "(1 other rank failed in turn, waiting on them)"
    )
