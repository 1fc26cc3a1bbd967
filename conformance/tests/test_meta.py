"""Meta-tests: the suite catches every mutant, accepts a correct third-party
backend given by path, and rejects a broken one (the suite tests itself)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from shampoo_conformance.suite.mutants import MUTANTS
from shampoo_conformance.suite.runner import mutant_is_killed

THIRD_PARTY = pathlib.Path(__file__).parent / "third_party"


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_suite_kills_mutant(name: str) -> None:
    killed, seconds, first = mutant_is_killed(name)
    assert killed, f"mutant {name!r} survived the conformance suite ({seconds:.0f} s)"


def _run(backend: str, *pytest_args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(THIRD_PARTY), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "shampoo_conformance",
            "run",
            "--backend",
            backend,
            "--",
            *pytest_args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def test_third_party_backend_by_path_passes() -> None:
    proc = _run("example_backend:make", "-q", "-k", "named_case or never_start or robustness")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


def test_broken_third_party_backend_fails_and_says_where() -> None:
    proc = _run("example_backend:make_broken", "-q", "-x", "-k", "named_case")
    assert proc.returncode != 0
    assert "FAILED" in proc.stdout and "first divergence at step 1" in proc.stdout
    assert "config: {" in proc.stdout  # the standalone reproduction


def test_missing_framework_is_skipped_not_failed() -> None:
    proc = _run("no_such_package_xyz:make")
    assert proc.returncode == 0
    assert "SKIPPED" in proc.stdout
