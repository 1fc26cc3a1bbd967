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
from hypothesis.errors import Unsatisfiable

from shampoo_conformance.backends import (
    BackendUnavailable,
    available_backends,
    get_backend,
    third_party_backends,
)
from shampoo_conformance.protocol import Backend
from shampoo_conformance.thirdparty.registry import deviation_for
from shampoo_spec import Inexpressible


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
        f"({', '.join(available_backends())}), a third-party library "
        f"({', '.join(third_party_backends())}), 'mutant:NAME', 'package.module:factory', "
        "or 'all' (default: our own backends; also $SHAMPOO_BACKEND).",
    )


def selected_backends(config: pytest.Config) -> list[str]:
    names = config.getoption("--backend") or [os.environ.get("SHAMPOO_BACKEND", "all")]
    out: list[str] = []
    for name in names:
        out.extend(available_backends() if name == "all" else [name])
    return out


#: Test arguments drawn from a third-party backend: its own named cases and its
#: documented deviations (attribute of the backend holding them).
_LIBRARY_ITEMS = {"library_case": "cases", "deviation": "deviations"}


def _library_items(name: str, attribute: str) -> list[str]:
    """Names of backend ``name``'s cases or deviations; ``["unavailable"]`` when its
    library is not installed (the backend fixture then skips with the install
    command); none for our own backends."""
    if name not in third_party_backends():
        return []
    try:
        items = getattr(get_backend(name), attribute)
    except BackendUnavailable:
        return ["unavailable"]
    return sorted(items) if isinstance(items, dict) else [item.name for item in items]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend" not in metafunc.fixturenames:
        return
    names = selected_backends(metafunc.config)
    key = next((k for k in _LIBRARY_ITEMS if k in metafunc.fixturenames), None)
    if key is None:
        metafunc.parametrize("backend", names, indirect=True, scope="session", ids=names)
        return
    pairs = [(n, item) for n in names for item in _library_items(n, _LIBRARY_ITEMS[key])]
    metafunc.parametrize(["backend", key], pairs, indirect=["backend"], scope="session",
                         ids=[f"{n}-{item}" for n, item in pairs])


@pytest.fixture(scope="session")
def backend(request: Any) -> Backend:
    try:
        return get_backend(request.param)
    except BackendUnavailable as err:
        pytest.skip(str(err))


def _test_id(item: pytest.Item) -> str:
    """``item``'s id without its backend: ``test_name[param-param]`` or ``test_name``."""
    callspec = getattr(item, "callspec", None)
    name = getattr(item, "originalname", item.name)
    if callspec is None:
        return str(name)
    rest = [str(v) for k, v in callspec.params.items() if k != "backend"]
    return f"{name}[{'-'.join(rest)}]" if rest else str(name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A third-party backend's documented deviations (docs/third-party.md) as expected
    failures: the suite fails only on a deviation nobody has explained."""
    deviations: dict[str, tuple[Any, ...]] = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        name = None if callspec is None else callspec.params.get("backend")
        if name not in third_party_backends():
            continue
        if name not in deviations:
            try:
                deviations[name] = tuple(getattr(get_backend(name), "deviations", ()))
            except BackendUnavailable:
                deviations[name] = ()
        found = deviation_for(deviations[name], _test_id(item))
        if found is not None:
            item.add_marker(pytest.mark.xfail(
                reason=f"documented {found.kind} deviation of {name}: {found.cause}",
                strict=False))


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Any:
    """A config the backend's library cannot express is a skip with the reason, not a pass."""
    try:
        return (yield)
    except Inexpressible as err:
        pytest.skip(f"not expressible by this backend: {err}")
    except Unsatisfiable:
        backend = pyfuncitem.funcargs.get("backend")
        if getattr(backend, "expressible", None) is None:
            raise
        pytest.skip("no config this law needs is expressible by this backend's library "
                    "(every example rejected by strategies.require_expressible)")
