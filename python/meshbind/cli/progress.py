"""A progress bar on stderr for a long step of a command."""

from __future__ import annotations

import sys
import time


class ProgressBar:
    """A bar on stderr for a step that has run two seconds or more (as tqdm users expect), redrawn
    at most twice a second; nothing for a quick one."""

    WIDTH = 30

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.drawn = 0.0

    def __call__(self, step: str, done: int, total: int) -> None:
        now = time.monotonic()
        finished = done >= total
        if now - self.started < 2.0 or (not finished and now - self.drawn < 0.5) or (finished and not self.drawn):
            return
        self.drawn = now
        filled = self.WIDTH * done // max(total, 1)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        end = "\n" if finished else ""
        print(f"\r{step}: [{bar}] {done:,}/{total:,} {now - self.started:.0f} s", end=end, file=sys.stderr, flush=True)
