"""Run a function on every rank of a local gloo world and collect what each rank returns.

Ranks start from a forkserver that imported torch once, so a world starts in seconds rather than
paying torch's import per rank. A rank that raises fails the run with its traceback, one that
dies fails it at once with its exit code (the other ranks are killed), and collectives time out
after ``timeout`` seconds instead of hanging. ``meshbind demo`` and the multi-process tests both
start their worlds here.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any


def free_port() -> int:
    """A localhost port free now, for the world's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, target: str, args: tuple[Any, ...], results: Any, timeout: float) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        module_name, _, function = target.partition(":")
        result = getattr(importlib.import_module(module_name), function)(*args)
        dist.barrier()
        results.put((rank, "ok", result))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


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


def run_local_world(world_size: int, target: str, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``target`` (``module:function``) called with ``args`` on each of ``world_size`` ranks; the
    results, by rank. Raises ``RuntimeError`` with every failing rank's traceback."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "meshbind"])
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, port, target, args, results, timeout), daemon=True)
        for rank in range(world_size)
    ]
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
    errors = [f"rank {rank}:\n{value}" for rank, (status, value) in sorted(collected.items()) if status != "ok"]
    if errors:
        raise RuntimeError(f"{target} failed:\n" + "\n".join(errors))
    return [collected[rank][1] for rank in range(world_size)]
