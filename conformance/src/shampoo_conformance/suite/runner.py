"""Run the property suite against a backend, and the mutation kill rate.

``run_suite`` is ``python -m shampoo_conformance run``: pytest over
:mod:`shampoo_conformance.suite` for one backend; exit status non-zero when
any property fails (pytest's summary names each failing property and its
reproduction). A backend whose framework is missing is reported as skipped
with status 0.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence

import pytest

from shampoo_conformance.backends import BackendUnavailable, get_backend
from shampoo_conformance.suite.mutants import MUTANTS


def run_suite(backend: str, pytest_args: Sequence[str] = ()) -> int:
    """Exit status of the suite against ``backend`` (0: all properties hold)."""
    try:
        get_backend(backend)
    except BackendUnavailable as err:
        print(f"SKIPPED backend {backend!r}: {err}")
        return 0
    args = [
        "--pyargs",
        "shampoo_conformance.suite",
        f"--backend={backend}",
        "-p",
        "no:cacheprovider",
        "-ra",
        *pytest_args,
    ]
    return int(pytest.main(args))


def mutant_is_killed(name: str, timeout_s: float = 600.0) -> tuple[bool, float, str]:
    """Run the suite (stopping at the first failure) against ``mutant:name``."""
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shampoo_conformance",
            "run",
            "--backend",
            f"mutant:{name}",
            "--",
            "-x",
            "-q",
            "-W",
            "ignore::DeprecationWarning",
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    return proc.returncode != 0, time.perf_counter() - start, failed[0] if failed else ""


def mutation_report() -> int:
    """Print the kill rate over every mutant; status 1 if any survives."""
    killed = 0
    print(f"{'mutant':28s} {'killed':7s} {'seconds':>8s}  first failing property")
    for m in MUTANTS:
        dead, seconds, first = mutant_is_killed(m.name)
        killed += dead
        where = first.removeprefix("FAILED ").split(" - ")[0].rsplit("/", 1)[-1] if first else "-"
        print(f"{m.name:28s} {'yes' if dead else 'NO':7s} {seconds:8.1f}  {where}")
    print(f"kill rate: {killed}/{len(MUTANTS)} = {killed / len(MUTANTS):.0%}")
    return 0 if killed == len(MUTANTS) else 1
