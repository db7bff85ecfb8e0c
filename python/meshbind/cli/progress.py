"""A progress bar on stderr for a long step of a command."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """A bar on stderr for a step that has run two seconds or more (as tqdm users expect), redrawn
    at most twice a second; nothing for a quick one. Once the step has moved it says how long the
    rest would take at its pace so far, as tqdm does."""

    WIDTH = 30

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.drawn = 0.0
        self.step = ""
        self.step_started = self.started
        self.step_done = 0
        self.line_open = False
        self.line_length = 0

    def __call__(self, step: str, done: int, total: int) -> None:
        now = time.monotonic()
        if step != self.step:  # the pace counts from the step's first report, what was done by then aside
            self.step, self.step_started, self.step_done = step, now, done
        finished = done >= total
        if now - self.started < 2.0 or (not finished and now - self.drawn < 0.5) or (finished and not self.drawn):
            return
        self.drawn = now
        filled = self.WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        end = "\n" if finished else ""
        self.line_open = not finished
        left = ""
        if self.step_done < done < total:
            pace = (now - self.step_started) / (done - self.step_done)
            left = f", about {duration_text(pace * (total - done))} left at this pace"
        line = f"{step}: [{bar}] {done:,}/{total:,} {now - self.started:.0f} s{left}"
        padded, self.line_length = line.ljust(self.line_length), len(line)  # blanks what a longer line left
        print(f"\r{padded}", end=end, file=sys.stderr, flush=True)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Ends the bar's line where its step was stopped part way (a time limit, Ctrl-C, an
        error), so that what the command prints next starts on a line of its own."""
        if self.line_open:
            print(file=sys.stderr, flush=True)


def duration_text(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3 h 20 min``: as precise as a wait needs."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"
