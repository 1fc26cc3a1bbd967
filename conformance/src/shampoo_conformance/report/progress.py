"""A small progress bar with an ETA on stderr, plain lines when stderr is not a terminal.

On a terminal the bar redraws one line in place (``\\r``) at most every
0.1 s. Elsewhere (CI logs, pipes, files) it prints a plain line only when
the work crosses another tenth of the total, so logs stay short. The ETA
assumes the remaining work runs at the average rate so far.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 28


def format_seconds(seconds: float) -> str:
    """``"42s"``, ``"3m05s"`` or ``"1h02m"``; ``"?"`` when unknown."""
    if not seconds >= 0 or seconds == float("inf"):
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Progress:
    """Units of work done out of ``total``; ``advance(n, label)`` after each piece."""

    def __init__(
        self, total: float, *, stream: TextIO | None = None, interactive: bool | None = None
    ) -> None:
        if not total > 0:
            raise ValueError(f"total = {total!r} is invalid: allowed a number > 0.")
        self.total = float(total)
        self.done = 0.0
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.interactive = bool(isatty and isatty()) if interactive is None else interactive
        self._start = time.perf_counter()
        self._last_draw = -1.0
        self._last_tenth = -1
        self.label = ""

    def eta_seconds(self) -> float:
        """Seconds left at the average rate so far (inf before any progress)."""
        if self.done <= 0:
            return float("inf")
        elapsed = time.perf_counter() - self._start
        return elapsed * (self.total - self.done) / self.done

    def line(self) -> str:
        """The text of the bar: ``[#####.....]  42%  label  ETA 1m10s``."""
        frac = min(1.0, self.done / self.total)
        filled = int(round(WIDTH * frac))
        bar = "#" * filled + "." * (WIDTH - filled)
        return f"[{bar}] {100 * frac:3.0f}%  {self.label}  ETA {format_seconds(self.eta_seconds())}"

    def advance(self, units: float = 1.0, label: str | None = None) -> None:
        if label is not None:
            self.label = label
        self.done = min(self.total, self.done + units)
        self._draw()

    def set_label(self, label: str) -> None:
        self.label = label
        self._draw()

    def _draw(self) -> None:
        now = time.perf_counter()
        if self.interactive:
            if now - self._last_draw < 0.1 and self.done < self.total:
                return
            self._last_draw = now
            self.stream.write("\r\x1b[2K" + self.line())
            self.stream.flush()
            return
        tenth = int(10 * self.done / self.total)
        if tenth > self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the bar's line (terminal) and print the elapsed time."""
        elapsed = format_seconds(time.perf_counter() - self._start)
        if self.interactive:
            self.stream.write("\r\x1b[2K")
        self.stream.write(f"done in {elapsed}\n")
        self.stream.flush()
