"""Traces that share nothing, run side by side in forked children: as many at once as this process
may use cores, each answer sent back pickled; a child runs its own pieces in order. A child starts
from this process's memory as it stands (a model built on ``meta``, a plan), so only answers cross.

torch's autograd engine refuses a backward in a child forked after this process ran one (its
threads do not survive a fork). A child that meets the refusal says so, and from then on every
piece runs here, in order, as it does where this platform cannot fork or one core is all there is.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch

Item = TypeVar("Item")
Result = TypeVar("Result")

_AUTOGRAD_REFUSES = "Unable to handle autograd's threading in combination with fork-based multiprocessing"
_REFUSED = "refused"
_refused_here = False
"""Whether a child of this process met autograd's refusal: no later piece forks."""
_in_a_child = False
"""Whether this process is a child: its pieces run in it, in order, as its siblings hold the other cores."""


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def dealt(items: Sequence[Item], shares: int) -> list[list[Item]]:
    """``items`` dealt in turn into at most ``shares`` shares, none empty: item ``i`` is in share
    ``i % len(result)`` at ``i // len(result)``."""
    count = max(1, min(shares, len(items)))
    return [list(items[share::count]) for share in range(count)] if items else []


def in_forks(
    work: Callable[[Item], Result],
    items: Sequence[Item],
    what: Callable[[Item], str],
    answered: Callable[[int, Result], None] | None = None,
) -> list[Result]:
    """``work`` of each of ``items``, in order, each in a forked child where one may fork (not in a
    child: it runs its pieces itself). ``answered(position, result)`` is called as each arrives,
    so a caller stopped part way keeps what was answered. A child's exception is raised here (the
    first to arrive); a child that ends without an answer (killed, out of memory) is a
    ``RuntimeError`` naming ``what`` it was doing. The other children are stopped either way."""
    global _refused_here
    results: dict[int, Result] = {}

    def keep(position: int, result: Result) -> None:
        results[position] = result
        if answered is not None:
            answered(position, result)

    forking = not (_refused_here or _in_a_child or usable_cores() <= 1 or "fork" not in multiprocessing.get_all_start_methods())
    if forking and _forked(work, items, what, keep):
        _refused_here = True
    for position, item in enumerate(items):
        if position not in results:
            keep(position, work(item))
    return [results[position] for position in range(len(items))]


def _forked(
    work: Callable[[Item], Result], items: Sequence[Item], what: Callable[[Item], str], keep: Callable[[int, Result], None]
) -> bool:
    """Runs ``items`` in children, their answers into ``results``; whether autograd refused one."""
    context = multiprocessing.get_context("fork")
    waiting = list(enumerate(items))
    running: dict[Connection, tuple[int, Any]] = {}  # by the pipe each child answers on
    try:
        while waiting or running:
            while waiting and len(running) < usable_cores():
                position, item = waiting.pop(0)
                reader, writer = context.Pipe(duplex=False)
                child = context.Process(target=_answer, args=(work, item, writer), daemon=True)
                child.start()
                writer.close()
                running[reader] = (position, child)
            for ready in wait(list(running)):
                assert isinstance(ready, Connection)
                position, child = running.pop(ready)
                try:
                    kind, value = ready.recv()
                except EOFError:
                    child.join()
                    raise RuntimeError(f"{what(items[position])} ended without an answer (exit code {child.exitcode})") from None
                finally:
                    ready.close()
                child.join()
                if kind == _REFUSED:
                    return True
                if kind == "raised":
                    raise value
                keep(position, value)
    finally:
        for reader, (_, child) in running.items():
            child.kill()
            child.join()
            reader.close()
    return False


def _answer(work: Callable[[Any], Any], item: Any, writer: Connection) -> None:
    global _in_a_child
    _in_a_child = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to answer: it stops its children
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
    try:
        answer: tuple[str, Any] = ("answered", work(item))
    except Exception as error:  # sent to the parent, which raises it or runs the piece itself
        answer = (_REFUSED, None) if _autograd_refused(error) else ("raised", _sendable(error))
    writer.send(answer)
    writer.close()


def _autograd_refused(error: BaseException | None) -> bool:
    while error is not None:
        if _AUTOGRAD_REFUSES in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _sendable(error: Exception) -> Exception:
    """``error``, or where it does not cross a pipe whole (an exception whose arguments do not
    rebuild it), a ``RuntimeError`` with its message."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
