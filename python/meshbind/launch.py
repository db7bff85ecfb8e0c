"""Run a function on every rank of a local gloo world and collect what each rank returns.

Ranks start from a forkserver that imported torch and its distributed packages once
(``PRELOADED``), so a world starts in seconds rather than paying those imports per rank. A rank
that raises fails the run with its traceback (a meshbind refusal with its message alone, once for
every rank that made it), one that dies fails it at once with its exit code (the other ranks are
killed), and collectives time out after ``timeout`` seconds instead of hanging. ``meshbind demo``
and the multi-process tests both start their worlds here.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from meshbind.errors import MeshbindError

PRELOADED = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "meshbind",
)
"""Imported once by the forkserver the ranks fork from, not again by each rank: every meshbind rank
runs DTensor and FSDP2, and pipelining (which brings ``torch._dynamo``) is the slowest import of all."""


def free_port() -> int:
    """A localhost port free now, for the world's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, target: str, args: tuple[Any, ...], results: Any, timeout: float) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the whole world
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        module_name, _, function = target.partition(":")
        result = getattr(importlib.import_module(module_name), function)(*args)
        dist.barrier()
        results.put((rank, "ok", result))
    except MeshbindError as error:  # a refusal says all it has to say: no traceback
        results.put((rank, "refused", f"{type(error).__name__}: {error}"))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ctrl-C ignored while the ranks start (a signal disposition their processes inherit), so
    only this process hears it and stops them all; from the main thread only, as Python allows."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _drain(results: Any, collected: dict[int, tuple[str, Any]]) -> bool:
    """Collect what is still in flight (a rank may exit right after sending); whether anything was."""
    found = False
    while True:
        try:
            rank, status, value = results.get(timeout=1.0)
        except queue.Empty:
            return found
        collected[rank] = (status, value)
        found = True


def _failure_text(target: str, failed: dict[int, tuple[str, str]], world_size: int) -> str:
    """What failed ranks raised. Refusals (``MeshbindError``) say it all: each message once, naming
    the ranks that made it, and the ranks that then failed waiting on them are only counted. With
    no refusal, every failing rank's traceback."""
    refusals: dict[str, list[int]] = {}
    for rank, (status, value) in failed.items():
        if status == "refused":
            refusals.setdefault(value, []).append(rank)
    if not refusals:
        return f"{target} failed:\n" + "\n".join(f"rank {rank}:\n{value}" for rank, (_, value) in failed.items())
    lines = [f"{_ranks_text(ranks, world_size)}: {text}" for text, ranks in refusals.items()]
    waiting = [rank for rank, (status, _) in failed.items() if status != "refused"]
    if waiting:
        lines.append(f"({len(waiting)} other rank{'s' * (len(waiting) > 1)} failed in turn, waiting on them)")
    return "\n".join(lines)


def _ranks_text(ranks: list[int], world_size: int) -> str:
    if len(ranks) == world_size:
        return "every rank"
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))


def run_local_world(world_size: int, target: str, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``target`` (``module:function``) called with ``args`` on each of ``world_size`` ranks; the
    results, by rank. Raises ``RuntimeError`` with what every failing rank raised: a meshbind
    refusal (``MeshbindError``) as its message, anything else with its traceback."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, port, target, args, results, timeout), daemon=True)
        for rank in range(world_size)
    ]
    with _sigint_ignored():  # the forkserver, started here, and its preload imports too
        for process in processes:
            process.start()
    collected: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout + 60
    try:
        while len(collected) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died (killed, os._exit, a crash) sends nothing: say so now, not at the deadline.
                dead = {r: p.exitcode for r, p in enumerate(processes) if r not in collected and p.exitcode is not None}
                if dead and not _drain(results, collected):
                    died = ", ".join(f"rank {r} (exit code {code})" for r, code in sorted(dead.items()))
                    raise RuntimeError(f"{died} of {target} died without a result") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(collected))
                    raise RuntimeError(f"ranks {missing} of {target} did not finish in {timeout + 60:.0f} s") from None
                continue
            collected[rank] = (status, value)
    except BaseException:
        for process in processes:  # the others would wait on the failed rank until their timeout
            process.kill()
        raise
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    failed = {rank: (status, value) for rank, (status, value) in sorted(collected.items()) if status != "ok"}
    if failed:
        raise RuntimeError(_failure_text(target, failed, world_size))
    return [collected[rank][1] for rank in range(world_size)]
