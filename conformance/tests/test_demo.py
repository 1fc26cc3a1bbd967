"""`python -m shampoo_conformance demo` runs the reference and prints its table."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from shampoo_conformance import demo
from shampoo_conformance.__main__ import build_parser, main


def _table_lines(text: str) -> list[list[str]]:
    """Rows of the table: lines whose first field is a step number."""
    fields = (line.split() for line in text.splitlines())
    return [row for row in fields if row and row[0].isdigit()]


@pytest.mark.parametrize("problem", sorted(demo.TUNED_LEARNING_RATES))
def test_demo_prints_a_table(problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--problem", problem, "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "loss shampoo" in out and "loss gd" in out and "time shampoo s" in out
    rows = _table_lines(out)
    assert [int(row[0]) for row in rows] == [0, 1, 2, 3]
    for row in rows:
        assert len(row) == 5
        assert all(math.isfinite(float(field)) for field in row)
    assert rows[0][1] == rows[0][2]  # both start from the same parameters


def test_run_demo_rows_match_steps() -> None:
    result = demo.run_demo("ill_conditioned_least_squares", steps=4)
    assert [row.step for row in result.rows] == [0, 1, 2, 3, 4]
    assert result.config.learning_rate == demo.TUNED_LEARNING_RATES[result.problem.name].shampoo
    seconds = [row.seconds_shampoo for row in result.rows]
    assert seconds == sorted(seconds)
    assert all(math.isfinite(row.loss_shampoo) for row in result.rows)


def test_shown_steps() -> None:
    assert demo.steps_to_shown(3) == [0, 1, 2, 3]
    assert demo.steps_to_shown(40) == [0, 1, 2, 5, 10, 20, 30, 40]
    assert demo.steps_to_shown(25) == [0, 1, 2, 5, 10, 20, 25]


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_run_demo_rejects_bad_steps(steps: object) -> None:
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        demo.run_demo(steps=steps)  # type: ignore[arg-type]


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["demo", "--steps", "0"], ["demo", "--problem", "mnist"], []):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "demo" in build_parser().format_help()
    capsys.readouterr()


def test_module_entry_point() -> None:
    """The real `python -m` path, with a tiny step count."""
    completed = subprocess.run(
        [sys.executable, "-m", "shampoo_conformance", "demo", "--steps", "2"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    assert [int(row[0]) for row in _table_lines(completed.stdout)] == [0, 1, 2]
