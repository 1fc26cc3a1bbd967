"""`python -m shampoo_conformance demo` is the backend report on its embedded default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shampoo_conformance.__main__ import build_parser, main
from shampoo_conformance.report import demo, settings_for
from shampoo_conformance.report import settings as S


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


def test_report_config_file_forms(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--config``: the spec's JSON form or a library's arguments; bad files are named."""
    import json

    import shampoo_spec as ss

    meta = {"lr": 0.01, "preconditioner_config": {"type": "AdamPreconditionerConfig"}}
    own = ss.ShampooConfig(spectral=ss.SpectralDescentConfig(method="svd"),
                           blocking=ss.BlockingConfig(merge_target_rank=2, skip_rank_lt=2))
    cases = {"meta.json": ({"from_meta": meta}, ss.from_meta(meta)),
             "own.json": (own.to_dict(), own),
             "google.json": ({"from_google": {"learning_rate": 0.1, "block_size": 8}},
                             ss.from_google({"learning_rate": 0.1, "block_size": 8})),
             "tearfree.json": ({"from_tearfree": {"learning_rate": 0.1, "options": {
                 "grafting_options": {"grafting_type": "SGD"}}}},
                 ss.from_tearfree({"grafting_options": {"grafting_type": "SGD"}}, 0.1))}
    for name, (data, want) in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        assert S.load_config(tmp_path / name) == want
    settings = settings_for("quick", config=own)
    assert settings.config == own
    (tmp_path / "bad.json").write_text(json.dumps({"from_meta": {"lr": -1}}))
    with pytest.raises(ValueError, match=r"--config .*bad\.json: .*lr"):
        S.load_config(tmp_path / "bad.json")
    with pytest.raises(SystemExit) as info:
        main(["demo", "--config", str(tmp_path / "missing.json")])
    assert info.value.code == 2 and "missing.json" in capsys.readouterr().err
