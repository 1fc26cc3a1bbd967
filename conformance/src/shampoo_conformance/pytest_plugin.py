"""pytest plugin: ``--backend`` selects what the conformance suite checks.

Registered as a ``pytest11`` entry point, so ``pytest --pyargs
shampoo_conformance.suite --backend torch`` works wherever the package is
installed. ``--backend`` may repeat; ``all`` (the default) means every
built-in backend, those whose framework is missing reported as skipped.
A third-party backend is named ``package.module:factory``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import settings

from .backends import Backend, BackendUnavailable, available_backends, get_backend


def register_profiles() -> None:
    """Hypothesis profiles: ``ci`` (small, derandomized), ``deep`` (many examples) and
    ``fuzz`` (``nox -s fuzz``: conformance/tests/test_fuzz.py scales its tests from
    ``max_examples``, so that every backend runs at least 10,000 cases; random
    seeds, no example database, so a read-only checkout works)."""
    settings.register_profile(
        "ci", max_examples=25, derandomize=True, deadline=None, print_blob=True, database=None
    )
    settings.register_profile("deep", max_examples=500, deadline=None, print_blob=True)
    settings.register_profile(
        "fuzz", max_examples=3400, deadline=None, print_blob=True, database=None
    )


register_profiles()
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "random_configs: a Hypothesis property over random configs (each example is a new "
        "config, so compiled backends compile once per example)",
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        action="append",
        default=None,
        help="backend for the Shampoo conformance suite: a built-in name "
        f"({', '.join(available_backends())}), 'mutant:NAME', 'package.module:factory', "
        "or 'all' (default; also $SHAMPOO_BACKEND).",
    )


def selected_backends(config: pytest.Config) -> list[str]:
    names = config.getoption("--backend") or [os.environ.get("SHAMPOO_BACKEND", "all")]
    out: list[str] = []
    for name in names:
        out.extend(available_backends() if name == "all" else [name])
    return out


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" in metafunc.fixturenames:
        names = selected_backends(metafunc.config)
        metafunc.parametrize("backend", names, indirect=True, scope="session", ids=names)


@pytest.fixture(scope="session")
def backend(request: Any) -> Backend:
    try:
        return get_backend(request.param)
    except BackendUnavailable as err:
        pytest.skip(str(err))
