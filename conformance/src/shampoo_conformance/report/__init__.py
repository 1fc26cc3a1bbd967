"""The backend report: accuracy, speed, memory and convergence of every backend.

``python -m shampoo_conformance report`` (and ``demo``, the same on a small
embedded default) runs one Shampoo configuration (:mod:`.settings`) through
every requested backend and measures

- :mod:`.accuracy`: deviation from the float64 reference, float64 and float32;
- :mod:`.timing`: optimizer step time, state size and peak memory vs AdamW, same framework;
- :mod:`.convergence`: steps to the target loss and final loss for Shampoo and
  AdamW, each at its tuned learning rate, over several seeds;

then :mod:`.recommend` turns the numbers into a recommendation by written
rules, and :mod:`.render` / :mod:`.plots` write the table, a Markdown report
and PNG plots (:mod:`.generate`). :mod:`.collect` runs the measurements with
a progress bar (:mod:`.progress`).
"""

from .collect import Report, collect
from .generate import main, write_report
from .settings import PRESETS, ReportSettings, report_shampoo_config, settings_for

__all__ = [
    "PRESETS",
    "Report",
    "ReportSettings",
    "collect",
    "main",
    "report_shampoo_config",
    "settings_for",
    "write_report",
]
