"""The closed-loop steppers of the report: equal to each backend's ``run`` and to each other."""

from __future__ import annotations

import numpy as np
import pytest

from shampoo_conformance import get_backend
from shampoo_conformance.adapters.first_order import AdamW
from shampoo_conformance.backends import BackendUnavailable, StepperUnavailable, has_stepper
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


@pytest.mark.parametrize("name", ["torch", "jax"])
def test_peak_bytes_bracket_the_state(name: str) -> None:
    """AdamW's peak holds its state (JAX: in and out, no donation) and at most a few
    parameter-sized temporaries; Shampoo's peak holds its state, above AdamW's."""
    backend = _backend(name)
    params, grads = _stream(11, seed=2)
    n_bytes = sum(int(np.prod(s)) for s in SHAPES.values()) * 8
    adamw = backend.stepper("adamw", params, lr=0.01)
    shampoo = backend.stepper("shampoo", params, lr=0.01, config=report_shampoo_config())
    adamw_peaks, shampoo_peaks = [], []
    for g in grads:
        adamw_peaks.append(adamw.step_with_peak(g)[1])
        shampoo_peaks.append(shampoo.step_with_peak(g)[1])
    state = adamw.state_bytes()
    live_copies = 2 if name == "jax" else 1
    assert all(live_copies * state <= p <= 2 * state + 4 * n_bytes for p in adamw_peaks[1:])
    assert all(p >= shampoo.state_bytes() for p in shampoo_peaks[1:])
    assert max(shampoo_peaks) > max(adamw_peaks)


def test_torch_allocation_peak_closed_form() -> None:
    """A step that allocates 8000 + 4000 bytes, frees 8000, allocates 800: peak 12000 + state."""
    torch = pytest.importorskip("torch")
    from shampoo_conformance.adapters.torch import Stepper

    class Allocating(torch.optim.Optimizer):
        def __init__(self, params):  # type: ignore[no-untyped-def]
            super().__init__(params, {})

        def step(self, closure=None):  # type: ignore[no-untyped-def]
            for p in self.param_groups[0]["params"]:
                self.state[p].setdefault("kept", torch.zeros(25, dtype=torch.float64))
            a = torch.empty(1000, dtype=torch.float64)
            b = torch.empty(500, dtype=torch.float64)
            del a
            c = torch.empty(100, dtype=torch.float64)
            del b, c

    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    stepper = Stepper(Allocating([p]), {"p": p})
    _, first = stepper.step_with_peak({"p": np.ones(3)})
    _, second = stepper.step_with_peak({"p": np.ones(3)})
    assert first == 200 + 12000  # the state is allocated inside the first step
    assert second == 200 + 12000  # then held before it (state_bytes) and not reallocated


def test_torch_peak_is_none_without_the_profiler_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch without the allocation-event interface: the step still happens, peak None."""
    torch = pytest.importorskip("torch")
    monkeypatch.delattr(torch._C._profiler, "_EventType")
    backend = _backend("torch")
    params, grads = _stream(1, seed=3)
    got, peak = backend.stepper("adamw", params, lr=0.1).step_with_peak(grads[0])
    assert peak is None
    assert not np.allclose(got["w"], params["w"])


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
