"""The closed-loop steppers of the report: equal to each backend's ``run`` and to each other."""

from __future__ import annotations

import numpy as np
import pytest

from shampoo_conformance import get_backend
from shampoo_conformance.backends import BackendUnavailable, StepperUnavailable, has_stepper
from shampoo_conformance.first_order import AdamW
from shampoo_conformance.report import report_shampoo_config

SHAPES = {"w": (5, 3), "b": (3,)}


def _stream(steps: int, seed: int = 0) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
    grads = [{k: rng.standard_normal(s) for k, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


def _backend(name: str):  # type: ignore[no-untyped-def]
    try:
        return get_backend(name)
    except BackendUnavailable as err:
        pytest.skip(str(err))


@pytest.mark.parametrize("name", ["reference", "torch", "jax"])
def test_shampoo_stepper_equals_run(name: str) -> None:
    """12 steps (roots at 10) of the report config, open loop, float64: same trajectory."""
    backend = _backend(name)
    config = report_shampoo_config()
    params, grads = _stream(12)
    want = backend.run(config, params, grads, dtype=np.float64)
    stepper = backend.stepper("shampoo", params, lr=config.learning_rate, config=config)
    for t, g in enumerate(grads):
        got = stepper.step(g)
        for k in SHAPES:
            np.testing.assert_allclose(got[k], want[t][k], rtol=1e-12, atol=1e-14,
                                       err_msg=f"{name} step {t + 1} param {k}")
        assert stepper.last_step_seconds >= 0.0
    # Against the reference too (the run functions are checked by the suite; this pins lr).
    ref = get_backend("reference").run(config, params, grads)
    np.testing.assert_allclose(got["w"], ref[-1]["w"], rtol=1e-9)
    assert not np.allclose(got["w"], params["w"])  # it moved


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_adamw_steppers_equal_numpy_adamw(name: str) -> None:
    """torch.optim.AdamW / optax.adamw == the NumPy AdamW, float64, with weight decay."""
    backend = _backend(name)
    params, grads = _stream(10, seed=1)
    ours = backend.stepper("adamw", params, lr=0.03, weight_decay=0.1)
    numpy_adamw = AdamW(params, lr=0.03, weight_decay=0.1)
    for t, g in enumerate(grads):
        got, want = ours.step(g), numpy_adamw.step(g)
        for k in SHAPES:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-14,
                                       err_msg=f"{name} step {t + 1} param {k}")


def test_numpy_adamw_first_step_closed_form() -> None:
    """At t = 1, m_hat = g and v_hat = g^2: the step is lr * (g / (|g| + eps) + wd * w)."""
    w0 = {"w": np.array([1.0, -2.0, 0.5])}
    g = {"w": np.array([0.3, -4.0, 1e-9])}
    lr, wd, eps = 0.1, 0.01, 1e-8
    got = AdamW(w0, lr=lr, weight_decay=wd, eps=eps).step(g)["w"]
    want = w0["w"] - lr * (g["w"] / (np.abs(g["w"]) + eps) + wd * w0["w"])
    np.testing.assert_allclose(got, want, rtol=1e-15)


def test_reference_state_bytes_closed_form() -> None:
    """X (8, 6): AdamW keeps m, v; Shampoo factors 8x8, 6x6, their roots, graft and filter."""
    backend = get_backend("reference")
    params = {"X": np.zeros((8, 6))}
    config = report_shampoo_config()
    adamw = backend.stepper("adamw", params, lr=0.1)
    shampoo = backend.stepper("shampoo", params, lr=0.1, config=config)
    assert adamw.state_bytes() == 2 * 48 * 8
    assert shampoo.state_bytes() == (2 * (64 + 36) + 2 * 48) * 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"optimizer": "sgd"}, "optimizer = 'sgd' is invalid"),
        ({"optimizer": "shampoo", "weight_decay": 0.1}, "weight_decay = 0.1 is invalid"),
        ({"optimizer": "adamw", "config": report_shampoo_config()}, "config is invalid"),
    ],
)
def test_stepper_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    for name in ("reference", "torch"):
        backend = _backend(name)
        with pytest.raises(ValueError, match=match):
            backend.stepper(params={"w": np.zeros(2)}, lr=0.1, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [{"lr": -1.0}, {"lr": 0.1, "betas": (0.9, 1.0)},
                                 {"lr": 0.1, "eps": float("nan")}])
def test_numpy_adamw_rejects_bad_hyperparameters(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="is invalid"):
        AdamW({"w": np.zeros(2)}, **bad)  # type: ignore[arg-type]


def test_open_loop_backend_has_no_stepper() -> None:
    mutant = get_backend("mutant:wrong_default_root")
    assert has_stepper(get_backend("reference"))
    assert not has_stepper(mutant)


def test_framework_backend_without_stepper_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend("torch")
    monkeypatch.delattr(backend._module, "stepper")  # type: ignore[attr-defined]
    assert not has_stepper(backend)
    with pytest.raises(StepperUnavailable, match="open-loop only"):
        backend.stepper("adamw", {"w": np.zeros(2)}, lr=0.1)  # type: ignore[attr-defined]
