"""The training progress display: tqdm's bar on a terminal, plain lines in a log file.

A bar redraws itself with `\\r`, which a log file keeps as one giant line; when the stream is not a terminal the
trainer prints a plain line instead, every `every` steps and at least every `seconds` (and at the first and last
step), as tqdm users expect of a log:

    gpt_tiny: step 120/600 (20%), 8.3 step/s, 0:14 elapsed, loss=2.731, tok/s=17558, mfu=26.9%
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

PLAIN_SECONDS = 30.0
"""A plain line at least this often while steps complete."""


class PlainProgress:
    """The part of tqdm's interface the loop uses (`update`, `set_postfix`, `n`, `refresh`, `close`), as lines."""

    def __init__(self, desc: str, total: int, initial: int = 0, *, every: int = 1, seconds: float = PLAIN_SECONDS,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.desc, self.total, self.n = desc, total, initial
        self.every, self.seconds = max(1, every), seconds
        self.stream, self.clock = stream or sys.stderr, clock
        self._start_n, self._start = initial, clock()
        self._last_line = self._start
        self._postfix: dict[str, Any] = {}

    def set_postfix(self, postfix: dict[str, Any], refresh: bool = False) -> None:
        self._postfix = dict(postfix)
        if refresh:
            self.refresh()

    def update(self, steps: int = 1) -> None:
        self.n += steps
        now = self.clock()
        if (self.n == self._start_n + 1 or self.n >= self.total or self.n % self.every == 0
                or now - self._last_line >= self.seconds):
            self._line(now)

    def refresh(self) -> None:
        """A line now (after a rollback moved `n` back)."""
        self._line(self.clock())

    def close(self) -> None:
        pass

    def _line(self, now: float) -> None:
        self._last_line = now
        elapsed = now - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        share = f" ({self.n / self.total:.0%})" if self.total else ""
        minutes, seconds = divmod(int(elapsed), 60)
        postfix = "".join(f", {k}={v}" for k, v in self._postfix.items())
        print(f"{self.desc}: step {self.n}/{self.total}{share}, {rate:.3g} step/s, {minutes}:{seconds:02d} elapsed"
              f"{postfix}", file=self.stream, flush=True)


def progress_display(desc: str, total: int, initial: int, *, every: int, stream: TextIO | None = None) -> Any:
    """tqdm's bar when `stream` (stderr by default) is a terminal, else `PlainProgress`."""
    stream = stream or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        return PlainProgress(desc, total, initial, every=every, stream=stream)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=stream)
