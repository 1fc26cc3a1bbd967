"""Libraries' own output kept out of the report's console: a log beside the report.

Third-party libraries print while they run (heavyball's einsum debug lines,
Google's hundreds of "Explicitly requested dtype float64" warnings under
32-bit JAX, torch's C++ log): left on the console they bury the progress
bar. :func:`captured` sends everything written to file descriptors 1 and 2
(Python's prints and C/C++ writes alike) and every warning into one log
file, keeps a stream on the console's stderr for the progress bar, and
counts what it caught, so the report can say how much there was and where.
Python's ``sys.stdout`` and ``sys.stderr`` go to the log as well, since they need
not write to those descriptors (under pytest or in a notebook they do not).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO


@dataclass
class CapturedOutput:
    """What :func:`captured` caught: the log's path, its lines and the warnings in it."""

    path: Path
    lines: int = 0
    warnings: int = 0
    distinct_warnings: int = 0

    def summary(self) -> str:
        """One sentence for the report (empty logs are said to be empty)."""
        if not self.lines:
            return f"The libraries wrote nothing to the console ({self.path.name} is empty)."
        return (f"The libraries' own console output, {self.lines} lines with "
                f"{self.warnings} warnings ({self.distinct_warnings} distinct), is in "
                f"{self.path.name} beside this report.")


@contextlib.contextmanager
def captured(path: Path) -> Iterator[tuple[CapturedOutput, TextIO]]:
    """Within the block, fds 1 and 2 and all warnings go to ``path``; yields the
    counts (final after the block) and a stream on the console's stderr."""
    path.parent.mkdir(parents=True, exist_ok=True)
    result = CapturedOutput(path)
    seen: set[tuple[str, str, int]] = set()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    console = os.fdopen(os.dup(saved[2]), "w", buffering=1)
    log = open(path, "w", buffering=1)  # noqa: SIM115 (closed in finally)
    original_show = warnings.showwarning

    def show(message: Any, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        result.warnings += 1
        seen.add((category.__name__, filename, lineno))
        log.write(warnings.formatwarning(message, category, filename, lineno, line))

    try:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        # Python's own streams too: sys.stdout need not write to fd 1 (pytest, notebooks).
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            warnings.simplefilter("always")  # count every one, not the first per place
            warnings.showwarning = show
            try:
                yield result, console
            finally:
                warnings.showwarning = original_show
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        log.close()
        console.close()
        result.distinct_warnings = len(seen)
        with open(path) as text:
            result.lines = sum(1 for _ in text)
