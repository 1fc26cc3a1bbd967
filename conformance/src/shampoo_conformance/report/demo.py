"""``python -m shampoo_conformance demo``: the backend report on its embedded default.

The demo is ``python -m shampoo_conformance report`` with the ``"demo"``
preset (:func:`shampoo_conformance.report.settings_for`): the
``digits_softmax`` and ``ill_conditioned_least_squares`` problems, every
installed backend of reference / torch / jax, a 7-point learning-rate grid
per optimizer, 3 seeds, 5 timing rounds. It prints the summary table and
the recommendation and writes ``report.md``, ``report.json`` and one
``convergence_<problem>.png`` per problem into ``--out``
(default ``shampoo-report``). It takes about a minute of compute on 2 idle cores.
"""

from __future__ import annotations

from pathlib import Path

from shampoo_conformance.report import main as report_main
from shampoo_conformance.report import settings_for

DEFAULT_OUT = Path("shampoo-report")


def main(out: Path | str = DEFAULT_OUT, *, plots: bool = True) -> int:
    """Run the demo report into ``out``; the report's exit status."""
    return report_main(settings_for("demo", out=out), plots=plots)
