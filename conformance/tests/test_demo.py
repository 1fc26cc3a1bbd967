"""`python -m shampoo_conformance demo` is the backend report on its embedded default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shampoo_conformance import demo
from shampoo_conformance.__main__ import build_parser, main
from shampoo_conformance.report import settings as S
from shampoo_conformance.report import settings_for


def test_demo_preset_is_small_and_complete() -> None:
    settings = settings_for("demo")
    assert settings.problems == S.DEMO_PROBLEMS
    assert settings.backends == ("reference", "torch", "jax")
    assert settings.seeds >= 2 and len(settings.grid) >= 5  # medians with a spread, a real grid
    assert set(S.DEMO_PROBLEMS) <= set(S.available_problems())


def test_demo_parser_defaults() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.preset == "demo" and args.out == str(demo.DEFAULT_OUT)
    assert args.problems is None and args.backends is None


def test_cli_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["demo", "--steps", "0"], ["demo", "--problems", "mnist"], []):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "demo" in build_parser().format_help()
    capsys.readouterr()


def test_module_entry_point(tmp_path: Path) -> None:
    """The real `python -m` path, reference only, 3 steps, no plots (fast)."""
    completed = subprocess.run(
        [sys.executable, "-m", "shampoo_conformance", "demo", "--out", str(tmp_path),
         "--backends", "reference", "--steps", "3", "--seeds", "1", "--no-plots"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    assert "steps shampoo" in completed.stdout and "Recommendation:" in completed.stdout
    assert "done in" in completed.stderr  # progress on stderr, not mixed into the table
    md = (tmp_path / "report.md").read_text()
    for problem in S.DEMO_PROBLEMS:
        assert f"| {problem} | reference | oracle |" in md
