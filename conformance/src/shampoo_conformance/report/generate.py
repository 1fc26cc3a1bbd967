"""Run the report and write it: terminal table on stdout, Markdown, JSON and PNGs in ``out``.

Files: ``report.md`` (everything, with the plots embedded),
``convergence_<problem>.png`` (one per problem), ``report.json`` (the raw
measurements: every curve, grid point, deviation and timing),
``library-output.log`` (what the libraries printed and warned while measured,
:mod:`.capture`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any, TextIO

from . import render
from .capture import captured
from .collect import Report, collect
from .settings import ReportSettings

#: The libraries' console output, beside the report (:mod:`.capture`).
CONSOLE_LOG = "library-output.log"


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON has no NaN/inf
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "to_dict"):
        return x.to_dict()
    return x


def write_report(report: Report, out: Path, *, plots: bool, command: str) -> list[Path]:
    """Write the files of the module docstring; their paths."""
    out.mkdir(parents=True, exist_ok=True)
    pngs: list[str] = []
    if plots:
        from .plots import plot_convergence

        pngs = plot_convergence(report, out)
    md = out / "report.md"
    md.write_text(render.markdown(report, pngs, command))
    raw = out / "report.json"
    raw.write_text(json.dumps(_jsonable(report), indent=1))
    log = [out / CONSOLE_LOG] if (out / CONSOLE_LOG).exists() else []
    return [md, raw, *(out / p for p in pngs), *log]


def main(
    settings: ReportSettings,
    *,
    plots: bool = True,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    command: str | None = None,
) -> int:
    """Measure, print the summary, write the files. Exit status 0 unless nothing could run.

    A missing framework is a line of the report, not an error; status 1
    when no requested backend is installed or a measurement raised.
    """
    stdout = sys.stdout if stdout is None else stdout
    # torch's C++ log reads this at import (before a backend imports torch):
    # its one-time allocator warning under the profiler (peak memory) would
    # otherwise break the progress line. Errors still print.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if plots:  # fail before minutes of measuring, not after
        from .plots import _pyplot

        _pyplot()
    command = command or "python -m shampoo_conformance " + shlex.join(sys.argv[1:])
    with captured(settings.out / CONSOLE_LOG) as (output, console):
        report = collect(settings, progress_stream=console if stderr is None else stderr)
    report.console_output = output.summary()
    paths = write_report(report, settings.out, plots=plots, command=command)
    print(render.terminal_summary(report), file=stdout)
    print("\nwritten: " + ", ".join(str(p) for p in paths), file=stdout)
    if not any(b.installed for b in report.backends):
        print("error: none of the requested backends is installed", file=sys.stderr)
        return 1
    return 1 if report.errors else 0
