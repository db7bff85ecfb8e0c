"""``meshbind plan``: layouts refused by check's rules, the rest traced and priced, and each listed
layout's figures the same as ``meshbind check`` gives for it."""

from __future__ import annotations

import json
import math
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshbind.names import Checkpointing
from meshbind.search.result import Candidate
from meshbind.search.search import _likely_fastest_first
from meshbind.search.space import Layout
from meshbind.world import World

TINY_LLAMA = {
    "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
}  # fmt: skip


def meshbind(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshbind", *arguments], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("plan") / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("page") / "plan.html"


@pytest.fixture(scope="module")
def search(config: str, page: Path) -> dict:
    """The search's JSON; its page written to ``page`` by the same run."""
    done = meshbind(
        "plan", "--hf-config", config, "--gpus", "4", "--gpu", "H100-SXM", "--device-memory", "80GiB",
        "--global-batch", "8", "--seq-len", "64", "--pp-schedule", "1F1B", "--activation-checkpointing", "none", "--json",
        "--html", str(page),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_world_is_a_candidate_refused_by_its_rule_or_traced(search: dict) -> None:
    candidates = search["candidates"]
    worlds = {tuple(c["axes"][a] for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp")) for c in candidates}
    assert len(worlds) == math.comb(2 + 4, 4)  # every ordered split of 2 * 2 GPUs over five axes
    kv_heads = [c for c in candidates if c["axes"]["tp"] == 4]
    assert kv_heads and all(c["refused"] == "plan: layout" for c in kv_heads)  # 2 kv heads over tp=4
    assert "num_key_value_heads" in kv_heads[0]["detail"]
    assert all(c["refused"] == "cp splits nothing" for c in candidates if c["axes"]["cp"] > 1)
    ranked = [candidates[i] for i in search["ranked"]]
    speeds = [c["tokens_per_second_per_gpu"] for c in ranked]
    assert ranked and speeds == sorted(speeds, reverse=True) and all(c["fits"] for c in ranked)
    assert len(search["commands"]) == len(ranked)


def test_a_listed_layout_gives_the_figures_check_gives(search: dict) -> None:
    candidates = search["candidates"]
    for position in (0, len(search["ranked"]) - 1):
        listed = candidates[search["ranked"][position]]
        words = shlex.split(search["commands"][position])
        assert words[:2] == ["meshbind", "check"]
        checked = meshbind(*words[1:], "--json")
        assert checked.returncode == 0, checked.stderr
        answer = json.loads(checked.stdout)
        assert answer["memory"]["peak_bytes"] == listed["peak_bytes"]
        assert answer["step_time"]["tokens_per_second_per_gpu"] == listed["tokens_per_second_per_gpu"]
        assert answer["step_time"]["step_s"] == listed["step_s"]


def test_the_front_is_every_layout_that_fits_no_other_beats_on_both(search: dict) -> None:
    candidates = search["candidates"]
    ranked = [candidates[i] for i in search["ranked"]]
    front = [candidates[i] for i in search["front"]]

    def figures(c: dict) -> tuple[int, float]:
        return c["peak_bytes"], c["tokens_per_second_per_gpu"]

    def beats(one: dict, other: dict) -> bool:
        (peak, speed), (other_peak, other_speed) = figures(one), figures(other)
        return peak <= other_peak and speed >= other_speed and (peak, speed) != (other_peak, other_speed)

    assert front and len(front) < len(ranked)  # some layouts are beaten here: the test tells them apart
    assert [figures(c) for c in front] == sorted(figures(c) for c in front)  # least memory first
    for candidate in ranked:
        if candidate in front:
            assert not any(beats(other, candidate) for other in ranked)
        else:  # beaten, or the same figures as one on the front
            assert any(beats(f, candidate) or figures(f) == figures(candidate) for f in front)


def test_the_page_draws_each_layout_that_fits_and_marks_the_front(search: dict, page: Path) -> None:
    from browser_pages import opened_page
    from selenium.webdriver.common.by import By

    candidates = search["candidates"]
    front_ranks = {search["ranked"].index(i) + 1 for i in search["front"]}
    with opened_page(page) as driver:
        points = driver.find_elements(By.CSS_SELECTOR, "#front circle.point")
        assert len(points) == len(search["ranked"])
        marked = {int(p.get_attribute("data-rank")) for p in points if "front" in p.get_attribute("class").split()}
        assert marked == front_ranks
        rows = driver.find_elements(By.CSS_SELECTOR, "#ranked tbody tr")
        assert len(rows) == min(10, len(search["ranked"]))
        first = candidates[search["ranked"][0]]
        assert rows[0].find_element(By.TAG_NAME, "code").text == search["commands"][0]
        assert f"{first['tokens_per_second_per_gpu']:,.0f}" in rows[0].text
        left_out = {row.find_elements(By.TAG_NAME, "td")[1].text: row.find_elements(By.TAG_NAME, "td")[0].text
                    for row in driver.find_elements(By.CSS_SELECTOR, "#left-out tr")}  # fmt: skip
        assert left_out == {rule: f"{count:,}" for rule, count in search["refusals"].items()}


def test_without_tracing_the_same_layouts_pass_the_rules_with_their_state(search: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshbind import GPUS, Cluster
    from meshbind.interop.hf_plans import from_hf_plan
    from meshbind.search import Choices, plan_layouts

    config = AutoConfig.for_model(**TINY_LLAMA)

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    model = build()
    untraced = plan_layouts(
        model, from_hf_plan(model), build=build, gpus=4, cluster=Cluster(GPUS["H100-SXM"]), device_memory=80 * 2**30,
        global_batch=8, seq_len=64, choices=Choices(["1F1B"], checkpointing=["none"]), trace=False,
    )  # fmt: skip
    assert not untraced.ranked and all(c.memory is None for c in untraced.candidates)
    counted = {json.dumps(c.to_dict(), sort_keys=True): c.state_bytes for c in untraced.candidates if c.rule is None}
    traced = [c for c in search["candidates"] if c["refused"] is None]
    keys = ("axes", "pp_schedule", "pp_microbatches", "activation_checkpointing", "param_dtype", "reduce_dtype")
    assert sorted(
        json.dumps(
            {k: c[k] for k in keys} | {"refused": None, "detail": None, "fits": None, "state_bytes": c["state_bytes"]},
            sort_keys=True,
        )
        for c in traced
    ) == sorted(counted)


def test_a_state_too_large_is_not_traced_and_nothing_fitting_names_the_least_memory(config: str) -> None:
    done = meshbind(
        "plan", "--hf-config", config, "--gpus", "2", "--gpu", "H100-SXM", "--device-memory", "64KiB",
        "--global-batch", "2", "--seq-len", "32", "--pp-schedule", "1F1B", "--activation-checkpointing", "none",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "does not fit: state alone" in done.stdout
    assert "no layout fits 64.00 KiB: the least any needs is" in done.stderr


def test_a_split_backward_under_selective_op_checkpointing_is_refused_untraced(config: str) -> None:
    done = meshbind(
        "plan", "--hf-config", config, "--gpus", "2", "--gpu", "H100-SXM", "--device-memory", "64KiB",
        "--global-batch", "8", "--seq-len", "32", "--pp-schedule", "DualPipeV", "--activation-checkpointing", "selective-op",
        "--json",
    )  # fmt: skip
    pipelined = [c for c in json.loads(done.stdout)["candidates"] if c["axes"]["pp"] == 2]
    assert pipelined and all(c["refused"] == "checkpointing under the schedule" for c in pipelined), pipelined
    assert "selective-op checkpointing allows one backward over a region" in pipelined[0]["detail"]


def test_a_gpu_count_no_layout_can_use_names_the_nearest_that_can(config: str) -> None:
    # 7 GPUs: tp 7 leaves a node of 8, a global batch of 16 does not split over 7 data-parallel
    # ranks, pp 7 has 4 blocks to split, cp splits nothing; 6 can run pp 3 · tp 2.
    done = meshbind(
        "plan", "--hf-config", config, "--gpus", "7", "--gpu", "H100-SXM", "--device-memory", "80GiB",
        "--global-batch", "16", "--seq-len", "64", "--json",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    answer = json.loads(done.stdout)
    assert answer["candidates"] and all(c["refused"] for c in answer["candidates"])
    assert math.prod(answer["nearest"]["axes"].values()) == 6 and answer["nearest"]["refused"] is None
    assert "no layout of this model can run on 7 GPUs (see the rules above): the nearest count that can is 6 GPUs" in done.stderr


def test_bad_flags_exit_2_naming_them(config: str) -> None:
    done = meshbind("plan", "--hf-config", config, "--gpus", "0", "--gpu", "H100-SXM", "--device-memory", "80GiB",
                    "--global-batch", "2", "--seq-len", "32")  # fmt: skip
    assert done.returncode == 2 and "--gpus" in done.stderr
    done = meshbind("plan", "--hf-config", config, "--gpus", "2", "--gpu", "H100-SXM", "--device-memory", "80GiB",
                    "--global-batch", "2", "--seq-len", "32", "--pp-schedule", "Nope")  # fmt: skip
    assert done.returncode == 2 and "Nope" in done.stderr
    done = meshbind("plan", "--hf-config", config, "--gpus", "2", "--gpu", "H100-SXM", "--device-memory", "80GiB",
                    "--global-batch", "2", "--seq-len", "32", "--html", "/no/such/folder/plan.html")  # fmt: skip
    assert done.returncode == 2
    assert "--html /no/such/folder/plan.html: the directory /no/such/folder does not exist" in done.stderr
    assert "checking the rules" not in done.stderr  # refused before any search


def test_ctrl_c_prints_the_best_found_so_far(config: str) -> None:
    command = [
        sys.executable, "-m", "meshbind", "plan", "--hf-config", config, "--gpus", "8", "--gpu", "H100-SXM",
        "--device-memory", "80GiB", "--global-batch", "16", "--seq-len", "64",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        seen = ""
        while "tracing layouts" not in seen and process.poll() is None:
            seen += process.stderr.read(1)  # type: ignore[union-attr]
        time.sleep(8)  # a few layouts traced
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130
    assert re.search(r"\(interrupted: [0-9,]+ left untraced; the best found so far\)", out)
    assert re.search(r"^ +1 +[0-9,]+ ", out, re.MULTILINE)  # a layout traced before the interrupt is ranked


def test_a_time_limit_lists_the_best_traced_by_then(config: str) -> None:
    done = meshbind("plan", "--hf-config", config, "--gpus", "8", "--gpu", "H100-SXM", "--device-memory", "80GiB",
                    "--global-batch", "16", "--seq-len", "64", "--time-limit", "10", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["out_of_time"] and found["time_limit"] == 10 and not found["interrupted"]
    assert found["ranked"] and found["untraced"] > 0  # some traced and ranked, the rest left
    candidates = found["candidates"]
    assert found["untraced"] == sum(1 for c in candidates if c["refused"] is None and "peak_bytes" not in c)
    assert 10 <= found["seconds"] < 10 + 10  # the children stopped at the limit


def test_a_time_limit_spent_before_any_trace_says_so(config: str) -> None:
    done = meshbind("plan", "--hf-config", config, "--gpus", "8", "--gpu", "H100-SXM", "--device-memory", "80GiB",
                    "--global-batch", "16", "--seq-len", "64", "--time-limit", "0.001")  # fmt: skip
    assert done.returncode == 1
    assert re.search(r"stopped by the 0.001 s time limit: [0-9,]+ left untraced", done.stdout)
    assert re.search(
        r"the 0.001 s time limit ended the search before it found a layout that fits \([0-9,]+ layouts whose state fits "
        r"left untraced\): give it more time \(--time-limit\)",
        done.stderr,
    )
    for bad in ("0", "-3", "soon", "inf"):
        refused = meshbind("plan", "--hf-config", config, "--gpus", "2", "--gpu", "H100-SXM", "--device-memory", "80GiB",
                           "--global-batch", "2", "--seq-len", "32", "--time-limit", bad)  # fmt: skip
        assert refused.returncode == 2 and f"--time-limit: a positive number of seconds, got {bad!r}" in refused.stderr


def test_a_bad_time_limit_is_refused_before_the_search() -> None:
    import threading

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshbind import GPUS, Cluster
    from meshbind.interop.hf_plans import from_hf_plan
    from meshbind.search import plan_layouts

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA), dtype=torch.float32)
    refused: list[BaseException] = []

    def search(time_limit: object) -> None:
        try:
            plan_layouts(
                model, from_hf_plan(model), build=lambda: model, gpus=2, cluster=Cluster(GPUS["H100-SXM"]),
                device_memory=2**30, global_batch=2, seq_len=32, time_limit=time_limit,  # type: ignore[arg-type]
            )  # fmt: skip
        except ValueError as error:
            refused.append(error)

    for bad in (-1, "60", True):
        search(bad)
    elsewhere = threading.Thread(target=search, args=(60,))
    elsewhere.start()
    elsewhere.join()
    assert [str(error) for error in refused[:3]] == [
        f"time_limit must be a number of seconds, 0 or more, got {bad!r}" for bad in (-1, "60", True)
    ]
    assert "only the main thread receives" in str(refused[3])


def test_layouts_are_traced_likeliest_to_rank_first_first() -> None:
    def candidate(dtype: str, pp: int, checkpointing: str, tp: int, state: int) -> Candidate:
        world = World(pp=pp, dp_replicate=1, dp_shard=8 // (pp * tp), cp=1, tp=tp, ep=1)
        schedule, microbatches = ("1F1B", pp) if pp > 1 else (None, None)
        layout = Layout(world, schedule, microbatches, Checkpointing.parse(checkpointing, "ac"), dtype)
        return Candidate(world, layout, state_bytes=state)

    expected = [
        candidate("bf16", 1, "none", 1, 3),
        candidate("bf16", 1, "selective-op", 1, 3),  # the same world's selective twin next
        candidate("bf16", 1, "none", 2, 2),
        candidate("bf16", 1, "selective-op", 2, 2),
        candidate("bf16", 1, "full", 1, 3),  # full recomputation after every other at the same pp
        candidate("bf16", 2, "none", 1, 2),
        candidate("fp32", 1, "none", 1, 1),
    ]
    assert sorted(reversed(expected), key=_likely_fastest_first) == expected


def test_the_rules_pass_dealt_among_forked_children_is_the_one_a_single_process_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each share of the worlds is checked in a forked child and the answers put back in the
    worlds' order, after torch's schedule orders were made in forked children too; three shares
    (more than the worlds' count divides evenly) against one process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshbind import GPUS, Cluster, forks
    from meshbind.interop.hf_plans import from_hf_plan
    from meshbind.pipeline import schedules
    from meshbind.search import Choices, plan_layouts
    from meshbind.search import rules as search_module

    config = AutoConfig.for_model(**TINY_LLAMA)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    heard: list[tuple[str, int, int]] = []

    def rules_pass() -> list[tuple[str, int | None]]:
        found = plan_layouts(
            model, from_hf_plan(model), build=lambda: model, gpus=8, cluster=Cluster(GPUS["H100-SXM"]),
            device_memory=2**20, global_batch=16, seq_len=64, choices=Choices(checkpointing=["none", "full"]), trace=False,
            progress=lambda *told: heard.append(told),
        )  # fmt: skip
        return [(json.dumps(c.to_dict(), sort_keys=True), c.state_bytes) for c in found.candidates]

    monkeypatch.setattr(schedules, "_ORDERS", {})  # torch's schedule orders made afresh, in the children
    monkeypatch.setattr(search_module, "usable_cores", lambda: 3)
    dealt = rules_pass()
    made_side_by_side = dict(schedules._ORDERS)
    assert made_side_by_side  # made in the children and kept here, each as this process makes it
    assert made_side_by_side == {key: schedules._torchs_order(*key) for key in made_side_by_side}
    worlds = math.comb(3 + 4, 4)  # every ordered split of 2 * 2 * 2 GPUs over five axes
    assert len(heard) == 3 * search_module.SHARES_PER_CORE and heard[-1] == ("checking the rules", worlds, worlds)
    assert [done for _, done, _ in heard] == sorted(done for _, done, _ in heard)  # the bar moves as each share answers
    monkeypatch.setattr(schedules, "_ORDERS", {})  # and afresh here
    monkeypatch.setattr(search_module, "usable_cores", lambda: 1)
    monkeypatch.setattr(forks, "usable_cores", lambda: 1)
    alone = rules_pass()
    assert dealt == alone
    assert {c[0].count('"refused": null') for c in alone} == {0, 1} and any(state for _, state in alone)
