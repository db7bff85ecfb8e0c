"""Pipeline ranks traced side by side in forked children (``meshbind/forks.py``): each case runs in a
fresh interpreter, as whether a child may run a backward depends on what its parent ran before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


def run_fresh(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter on two cores, bounded in time."""
    return subprocess.run([sys.executable, "-c", FRESH + textwrap.dedent(script)], capture_output=True, text=True, timeout=600)


FRESH = """
import os
os.sched_setaffinity(0, set(list(os.sched_getaffinity(0))[:2]))

def raised(call):
    try:
        call()
    except Exception as error:
        return error
    raise AssertionError("no error")
"""


needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="forks run side by side on two cores or more")


def test_items_are_dealt_in_turn_into_shares_none_empty() -> None:
    from meshbind.forks import dealt

    items = list(range(10))
    for shares in (1, 3, 4, 10, 25):
        shared = dealt(items, shares)
        assert len(shared) == min(shares, len(items)) and all(shared)
        assert all(shared[i % len(shared)][i // len(shared)] == item for i, item in enumerate(items))
    assert dealt([], 4) == []


@needs_two_cores
def test_pieces_answer_in_order_from_forked_children() -> None:
    done = run_fresh(
        """
        from meshbind.forks import in_forks
        answers = in_forks(lambda item: (os.getpid(), item * item), [1, 2, 3, 4, 5], lambda item: f"piece {item}")
        assert [square for _, square in answers] == [1, 4, 9, 16, 25], answers
        assert os.getpid() not in {pid for pid, _ in answers} and len({pid for pid, _ in answers}) == 5, answers
        """
    )
    assert done.returncode == 0, done.stderr


@needs_two_cores
def test_each_answer_is_kept_as_it_arrives_and_a_child_runs_its_own_pieces_itself() -> None:
    done = run_fresh(
        """
        from meshbind.forks import in_forks
        def nested(item):  # in a child: its pieces run in it, not in grandchildren
            return os.getpid(), in_forks(lambda inner: os.getpid(), [item, item], lambda inner: f"inner {inner}")
        seen = []
        answers = in_forks(nested, [1, 2, 3], lambda item: f"piece {item}", lambda position, answer: seen.append(position))
        assert sorted(seen) == [0, 1, 2], seen
        assert all(inner == [pid, pid] and pid != os.getpid() for pid, inner in answers), answers
        """
    )
    assert done.returncode == 0, done.stderr


@needs_two_cores
def test_a_childs_error_is_raised_here_and_no_child_is_left() -> None:
    done = run_fresh(
        """
        import multiprocessing, time
        from meshbind.forks import in_forks
        def work(item):
            if item == 2:
                raise ValueError(f"piece {item} is bad")
            time.sleep(30 if item == 1 else 0)  # still running when the error arrives: stopped
            return item
        error = raised(lambda: in_forks(work, [1, 2, 3], lambda item: f"piece {item}"))
        assert isinstance(error, ValueError) and str(error) == "piece 2 is bad", error
        assert not multiprocessing.active_children()
        """
    )
    assert done.returncode == 0, done.stderr


@needs_two_cores
def test_a_child_that_dies_is_named() -> None:
    done = run_fresh(
        """
        import signal
        from meshbind.forks import in_forks
        def work(item):
            if item == 2:
                os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
            return item
        error = raised(lambda: in_forks(work, [1, 2], lambda item: f"tracing piece {item}"))
        assert isinstance(error, RuntimeError), error
        assert str(error) == "tracing piece 2 ended without an answer (exit code -9)", error
        """
    )
    assert done.returncode == 0, done.stderr


@needs_two_cores
def test_after_a_backward_here_the_pieces_run_here() -> None:
    """torch's autograd refuses a backward in a child forked after its parent ran one on fake
    tensors, as a trace does: the pieces run in this process, with the same answers, and nothing
    later forks."""
    done = run_fresh(
        """
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from meshbind import forks
        def work(item):
            weight = torch.ones(3, requires_grad=True)
            (weight * item).sum().backward()
            return os.getpid(), weight.grad.tolist()
        first = forks.in_forks(work, [1, 2], str)
        assert all(pid != os.getpid() for pid, _ in first), first
        with FakeTensorMode():
            weight = torch.ones(3, requires_grad=True)
            (weight * 2).sum().backward()
        again = forks.in_forks(work, [1, 2], str)
        assert [grad for _, grad in again] == [[1.0] * 3, [2.0] * 3] == [grad for _, grad in first], again
        assert all(pid == os.getpid() for pid, _ in again), again
        assert forks.in_forks(lambda item: os.getpid(), [1, 2], str) == [os.getpid()] * 2
        """
    )
    assert done.returncode == 0, done.stderr


PIPELINED = """
import json, torch
from meshbind import FullyShard, LayoutContext, resolve_plan, step_memory_and_comms
from meshbind.examples.moe_transformer import MoETransformer, TransformerConfig, loss_head_request
from meshbind.pipeline import Pipeline

forked = []
fork = os.fork
os.fork = lambda: forked.append(1) or fork()
config = TransformerConfig(layers=10, experts=4)
with torch.device("meta"):
    model = MoETransformer(config)
context = LayoutContext({"pp": 4, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1})
plan = resolve_plan(model, [loss_head_request()], context, fully_shard=FullyShard(("blocks.*.moe", "blocks.*")), index=True)
pipeline = Pipeline("DualPipeV", microbatches=8)
memory, comms = step_memory_and_comms(lambda: MoETransformer(config), plan, batch=8, seq_len=16, pipeline=pipeline)
answer = {
    "collectives": [[c.to_dict() for c in rank_class.collectives] for rank_class in comms.classes],
    "timelines": [[repr(event) for event in rank_class.work.timelines[0].events] for rank_class in comms.classes],
    "traced": [rank_class.traced for rank_class in comms.classes],
    "peaks": [(rank_class.peak_bytes, rank_class.live_at_peak, rank_class.peak_action) for rank_class in memory.classes],
    "forked": len(forked),
}
print(json.dumps(answer))
"""


@needs_two_cores
def test_pipeline_ranks_traced_in_forks_answer_as_traced_here() -> None:
    forked, here = run_fresh(PIPELINED), run_fresh("os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n" + PIPELINED)
    assert forked.returncode == 0, forked.stderr
    assert here.returncode == 0, here.stderr
    in_forks, in_process = (json.loads(done.stdout.splitlines()[-1]) for done in (forked, here))
    assert in_forks.pop("forked") >= 3 and in_process.pop("forked") == 0
    assert in_forks == in_process
