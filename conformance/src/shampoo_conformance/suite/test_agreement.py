"""Every backend equals the reference within the derived tolerance (docs/spec.md s. 5)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shampoo_conformance.protocol import Backend
from shampoo_conformance.suite import strategies as S
from shampoo_conformance.suite import user_runs
from shampoo_conformance.suite.cases import CASE_SHAPES, make_problem, named_cases
from shampoo_conformance.suite.divergence import assert_matches_reference, first_divergence
from shampoo_conformance.suite.tolerances import bound_and_reference

CASES = {case.name: case for case in named_cases()}
FLOAT32_CASES = [
    name
    for name, case in CASES.items()
    if type(case.config.root_inverse).__name__ == "EighConfig"
    and case.config.eigenvalue_correction is None
]


def _supports(backend: Backend, dtype: type) -> bool:
    return np.dtype(dtype) in [
        np.dtype(d) for d in getattr(backend, "dtypes", (np.float64, np.float32))
    ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_case_float64(backend: Backend, name: str) -> None:
    case = CASES[name]
    params, grads = case.problem()
    assert_matches_reference(backend, case.config, params, grads, np.float64, seed=case.seed)


@pytest.mark.parametrize("name", sorted(FLOAT32_CASES))
def test_named_case_float32(backend: Backend, name: str) -> None:
    if not _supports(backend, np.float32):
        pytest.skip(f"backend {backend.name!r} runs float64 only")
    case = CASES[name]
    params, grads = case.problem()
    assert_matches_reference(backend, case.config, params, grads, np.float32, seed=case.seed)


@pytest.mark.random_configs
@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    shapes=S.named_shapes(),
    steps=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(S.STREAM_KINDS),
)
def test_random_config_float64(
    backend: Backend,
    data: st.DataObject,
    shapes: dict[str, tuple[int, ...]],
    steps: int,
    seed: int,
    kind: str,
) -> None:
    config = data.draw(S.configs_for(backend), label="config")
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = S.gradient_stream(shapes, steps, seed + 1, kind)
    assert_matches_reference(backend, config, params, grads, np.float64, seed=seed)


def test_library_case_float64(backend: Backend, library_case: str) -> None:
    """A third-party backend's named cases: its library's own arguments (those ``nox -s
    anchors`` checks on a model), imported, against the reference on the named cases'
    problem. None for our own backends (their named cases are above)."""
    config = backend.cases[library_case]  # type: ignore[attr-defined]
    params, grads = make_problem(CASE_SHAPES, 10, 0)
    assert_matches_reference(backend, config, params, grads, np.float64, seed=0)


def test_library_case_float32(backend: Backend, library_case: str) -> None:
    """The same in float32, where the float32 bound is derived (eigh roots, no eq. 17)."""
    config = backend.cases[library_case]  # type: ignore[attr-defined]
    if type(config.root_inverse).__name__ != "EighConfig" or config.eigenvalue_correction:
        pytest.skip("the float32 bound is derived for eigh roots without eq. (17)")
    if not _supports(backend, np.float32):
        pytest.skip(f"backend {backend.name!r} runs float64 only")
    params, grads = make_problem(CASE_SHAPES, 10, 0)
    assert_matches_reference(backend, config, params, grads, np.float32, seed=0)


def test_documented_deviation(backend: Backend, deviation: str) -> None:
    """Each deviation docs/third-party.md documents still exists: its demonstration
    leaves the reference's tolerance (else the documentation is stale: update it); one
    without a config whose tests are side-effect or defaults properties
    (suite/user_runs.py) still fails them."""
    found = {d.name: d for d in backend.deviations}[deviation]  # type: ignore[attr-defined]
    if found.config is None and (shown := user_runs.demonstrate(backend, found)):
        # Shown by a side-effect or defaults property: that check still fails.
        print(f"{backend.name} {deviation}: " + "; ".join(shown))
        return
    if found.config is None:
        pytest.skip(f"{deviation}: our importer refuses the library's arguments for it, or "
                    "no config shows it apart from another deviation; the adapter's own "
                    f"tests demonstrate it ({found.cause})")
    params, grads = make_problem(found.shapes or CASE_SHAPES, 10, 0)
    bound, ref = bound_and_reference(found.config, params, grads, np.float64)
    try:
        ours = backend.run(found.config, params, grads, dtype=np.float64)
    except Exception as err:  # noqa: BLE001  (a crash is the documented deviation)
        print(f"{backend.name} {deviation}: raises {type(err).__name__}: {err}")
        return
    div = first_divergence(ours, ref, params, bound)
    assert div is not None, (
        f"documented deviation {deviation!r} of {backend.name!r} no longer reproduces: "
        "the library changed; update docs/third-party.md and the backend's DEVIATIONS"
    )
    print(f"{backend.name} {deviation}: {div.describe()}")
