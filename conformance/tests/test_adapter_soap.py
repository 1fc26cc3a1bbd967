"""The SOAP backends (pytorch-optimizer's and heavyball's ``SOAP``): translation, and
SOAP written down exactly.

``model`` below is SOAP as the two libraries compute it (float64 NumPy), read
from their sources (adapters/soap.py and the two adapters cite the lines),
with each rule where SOAP differs from the spec's eigenvalue-corrected
Shampoo a switch named after the backend's documented deviation. The tests
check that the model with every rule on equals the library (so the reading
is complete), with every rule off equals the reference on the config the
adapter maps the arguments to (so the mapping is right and nothing else
differs), and that each rule alone takes the reference out of its
tolerance (the measured sizes are docs/third-party.md's).

Each library's tests skip where it is not installed; the thirdparty nox
sessions install them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Collection, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shampoo_spec as ss
from shampoo_conformance.suite.cases import make_problem
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import bound_and_reference
from shampoo_conformance.thirdparty.soap import FULL_RANK_SHAPES

#: backend -> (library in the model, module it needs, adapter module)
BACKENDS = {
    "pytorch-optimizer-soap": ("pytorch-optimizer", "pytorch_optimizer",
                               "shampoo_conformance.thirdparty.pytorch_optimizer_soap"),
    "heavyball-soap": ("heavyball", "heavyball", "shampoo_conformance.thirdparty.heavyball_soap"),
}


@pytest.fixture(params=sorted(BACKENDS))
def adapter(request: Any) -> ModuleType:
    library, needs, module = BACKENDS[request.param]
    pytest.importorskip(needs)
    return importlib.import_module(module)


def _library(adapter: ModuleType) -> str:
    return BACKENDS[adapter.BACKEND][0]


#: The rules where SOAP differs from the spec, per library.
RULES = {
    "pytorch-optimizer": ("first_step_skipped", "stale_basis", "eigh_first_basis",
                          "qr_column_order", "float32_qr", "epsilon_before_bias_correction",
                          "decay_after_update"),
    "heavyball": ("first_step_skipped", "stale_basis", "eigh_first_basis", "qr_column_order",
                  "qr_ridge", "epsilon_floor", "float32_learning_rate",
                  "float32_statistics_weight", "precondition_schedule_rounding"),
}


#: Deviations a user's run shows (its side effects, its defaults' merge), not the
#: model's numbers: the adapter tests below and test_adapter_pytorch_optimizer.py
#: demonstrate them.
USER_RUN_ONLY = frozenset({"unknown_arguments_swallowed", "grad_negated_by_maximize",
                           "grads_consumed", "merge_dims_default"})


def _mode(x: np.ndarray, m: np.ndarray, k: int) -> np.ndarray:
    """``x x_k m``: dim k of x multiplied by the matrix m (out index first)."""
    return np.moveaxis(np.tensordot(m, x, axes=([1], [k])), 0, k)


def _rotate(x: np.ndarray, qs: Sequence[np.ndarray | None], into: bool) -> np.ndarray:
    for k, q in enumerate(qs):
        if q is not None:
            x = _mode(x, q.T if into else q, k)
    return x


def _gram(g: np.ndarray, k: int) -> np.ndarray:
    other = [i for i in range(g.ndim) if i != k]
    return np.tensordot(g, g, axes=(other, other))


def _spec_qr(q: np.ndarray, a: np.ndarray, ridge: float, float32: bool) -> np.ndarray:
    """Eq. (17c), one step: B = Q^T (A + ridge I) Q = Q' R, Q <- Q Q', sorted by diag(R Q')
    (the QR in float32 with ``float32``)."""
    b = q.T @ (a + ridge * np.eye(a.shape[0])) @ q
    step, r = np.linalg.qr(b.astype(np.float32)) if float32 else np.linalg.qr(b)
    step, r = step.astype(np.float64), r.astype(np.float64)
    order = np.argsort(np.diag(r @ step), kind="stable")
    return np.asarray((q @ step)[:, order], dtype=np.float64)


def model(
    library: str,
    w0: np.ndarray,
    grads: Sequence[np.ndarray],
    *,
    lr: float,
    betas: tuple[float, float],
    shampoo_beta: float,
    eps: float,
    weight_decay: float,
    frequency: int,
    correct_bias: bool = True,
    precondition_1d: bool = False,
    spec: Collection[str] = (),
) -> list[np.ndarray]:
    """The parameter after each step of ``grads`` (one parameter, float64)."""
    unknown = set(spec) - set(RULES[library])
    assert not unknown, unknown
    lib = {rule: rule not in spec for rule in RULES[library]}
    b1, b2 = betas
    w = np.array(w0, dtype=np.float64)
    shape = w.shape
    dims = [k for k, n in enumerate(shape)
            if n > 1 and (len(shape) >= 2 or precondition_1d)]
    stats: dict[int, np.ndarray] = {k: np.zeros((shape[k], shape[k])) for k in dims}
    qs: list[np.ndarray | None] = [np.eye(n) if k in dims else None for k, n in enumerate(shape)]
    d = np.zeros(shape)
    f = np.zeros(shape)
    count = 0  # the updates D and F have absorbed
    accumulated = 0.0  # heavyball's schedule (utils.psgd_should_update)
    out = []

    def due(t: int) -> bool:
        """Whether new bases are computed at step t (from the statistics through t): at
        step 1 (SOAP's init; eq. 8's start step with roots_before_start=False), then
        pytorch-optimizer at (t - 1) % f == 0 (period_anchor "start"), heavyball where a
        running sum of 1 / f passes an integer (spec: t % f == 0, "end")."""
        nonlocal accumulated
        before = accumulated
        accumulated += 1 / frequency
        if t == 1:
            return True
        if library == "heavyball":
            if lib["precondition_schedule_rounding"]:
                return int(accumulated) > int(before)
            return t % frequency == 0
        return (t - 1) % frequency == 0

    def new_bases(t: int) -> None:
        nonlocal d
        for k in dims:
            a = stats[k]
            q = qs[k]
            assert q is not None
            lam = float(np.linalg.eigvalsh(a)[-1])
            if t == 1 and lib["eigh_first_basis"]:
                basis = np.linalg.eigh(a + 1e-30 * np.eye(a.shape[0]))[1]
                # Descending, as SOAP flips it (its QR pre-sorts descending too); the spec's
                # QR sorts ascending after (eq. 17c), so its column order then.
                qs[k] = basis[:, ::-1] if lib["qr_column_order"] else basis
                continue
            product = a @ q
            est = np.sum(q * product, axis=0)
            ridge = 0.0
            if library == "heavyball":
                ridge = 1e-8 * (float(np.max(np.abs(est))) if lib["qr_ridge"] else max(lam, 0.0))
            if not lib["qr_column_order"]:
                qs[k] = _spec_qr(q, a, ridge,
                                 library == "pytorch-optimizer" and lib["float32_qr"])
                continue
            order = np.argsort(-est, kind="stable")
            work = (product + ridge * q)[:, order]
            if library == "heavyball":
                qq, r = np.linalg.qr(work)
                qq = qq * np.where(np.diag(r) < 0, -1.0, 1.0)
                new = np.empty_like(qq)
                new[:, order] = qq  # back to the old columns' places (D stays aligned)
                qs[k] = new
            else:
                d = np.take(d, order, axis=k)  # D follows the sorted columns
                if lib["float32_qr"]:
                    qs[k] = np.linalg.qr(work.astype(np.float32))[0].astype(np.float64)
                else:
                    qs[k] = np.linalg.qr(work)[0]

    def statistics(g: np.ndarray, t: int) -> None:
        keep, weight = shampoo_beta, 1 - shampoo_beta
        if library == "heavyball" and lib["float32_statistics_weight"] and t == 1:
            keep, weight = 0.0, 1.0  # its init: the first outer product (utils.init_preconditioner)
        elif library == "heavyball" and lib["float32_statistics_weight"]:
            # heavyball keeps the bias-corrected statistics, weight (1 - b) / (1 - b^t)
            # (utils.beta_debias) built from a Python float and the int64 step tensor, so in
            # float32; the scale is immaterial to the bases, the rounding is not.
            f32 = np.float32
            # torch: b ** step is powf; a Python float over a tensor is its reciprocal times it.
            q = f32(f32(f32(1) / (f32(1) - f32(shampoo_beta) ** f32(t))) * f32(1 - shampoo_beta))
            beta = f32(f32(1) - q)
            weight = float(f32(f32(1) - beta))
            keep = float(f32(f32(1) - f32(weight)))
        for k in dims:
            stats[k] = keep * stats[k] + weight * _gram(g, k)

    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, dtype=np.float64)
        if not lib["stale_basis"]:
            statistics(g, t)
            if due(t):
                new_bases(t)
        if not (t == 1 and lib["first_step_skipped"]):
            rotated = _rotate(g, qs, into=True)
            count += 1
            f = b1 * f + (1 - b1) * g
            d = b2 * d + (1 - b2) * rotated**2
            bc1 = 1 - b1**count if correct_bias else 1.0
            bc2 = 1 - b2**count if correct_bias else 1.0
            numerator = _rotate(f / bc1, qs, into=True)
            if library == "heavyball" and lib["epsilon_floor"]:
                direction = numerator / np.maximum(np.sqrt(d / bc2), eps)
            elif library == "pytorch-optimizer" and lib["epsilon_before_bias_correction"]:
                direction = numerator * np.sqrt(bc2) / (np.sqrt(d) + eps)
            else:
                direction = numerator / (np.sqrt(d / bc2) + eps)
            p = _rotate(direction, qs, into=False)
            rate = lr
            if library == "heavyball" and lib["float32_learning_rate"]:
                # lr = base_lr * step / step.clamp(min=warmup_steps + 1) with the int64 step
                # tensor (chainable.py, _step_inner): float32.
                f32 = np.float32
                rate = float(f32(f32(f32(lr) * f32(t)) / f32(t)))
            if library == "pytorch-optimizer" and lib["decay_after_update"]:
                w = (w - lr * p) * (1 - lr * weight_decay)
            else:
                w = w * (1 - rate * weight_decay) - rate * p
        if lib["stale_basis"]:
            statistics(g, t)
            if due(t):
                new_bases(t)
        out.append(w.copy())
    return out


# ----------------------------------------------------------------- the tests
#: Arguments that exercise every rule within 10 steps: a basis every 3 steps (a
#: refresh that heavyball's running sum of 1/3 moves from step 6 to 7), betas and a
#: shampoo_beta not exact in float32, an epsilon and a decay large enough to show. The
#: epsilon also sets the bound: eq. (17) amplifies rounding noise by up to ||G|| / eps
#: (docs/spec.md section 5), so at 1e-6 the float32 learning rate's 3e-8 per step
#: would hide inside it; at 1e-4 each rule alone leaves it.
PROBE = {"lr": 0.1, "betas": (0.9, 0.95), "shampoo_beta": 0.9, "eps": 1e-4,
         "weight_decay": 0.1, "precondition_frequency": 3}


def _model_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    k = dict(kwargs)
    out = {"lr": k["lr"], "betas": tuple(k["betas"]), "eps": k["eps"],
           "weight_decay": k["weight_decay"], "frequency": k["precondition_frequency"],
           "shampoo_beta": k["betas"][1] if k.get("shampoo_beta") is None else k["shampoo_beta"],
           "correct_bias": k.get("correct_bias", True),
           "precondition_1d": k.get("precondition_1d", False)}
    return out


def _model_run(library: str, params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]],
               kwargs: dict[str, Any], spec: Collection[str]) -> list[dict[str, np.ndarray]]:
    per = {name: model(library, w, [g[name] for g in grads], spec=spec, **_model_kwargs(kwargs))
           for name, w in params.items()}
    return [{name: per[name][t] for name in params} for t in range(len(grads))]


def _worst(ours: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]],
           w0: dict[str, np.ndarray]) -> float:
    """max over parameters of max_t |ours_t - want_t| / max_t |want_t - w0|."""
    worst = 0.0
    for k in w0:
        moved = max(float(np.linalg.norm(b[k] - w0[k])) for b in want)
        err = max(float(np.linalg.norm(a[k] - b[k])) for a, b in zip(ours, want, strict=True))
        worst = max(worst, err / moved if moved > 0 else err)
    return worst


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_kwargs_round_trip_its_own_arguments(adapter: ModuleType, data: st.DataObject) -> None:
    """Its kwargs -> config -> the same kwargs (and the same config)."""
    kwargs = data.draw(adapter._kwargs())
    config = adapter.from_kwargs(kwargs)
    back = adapter.soap_kwargs(config)
    assert adapter.from_kwargs(back) == config
    assert adapter.expressible(config) is None
    want = {**kwargs, "shampoo_beta": _model_kwargs(kwargs)["shampoo_beta"]}
    for key, value in back.items():
        if key in want:
            assert value == want[key], key


def test_refuses_what_it_cannot_say_naming_the_field(adapter: ModuleType) -> None:
    config = adapter.base_config()
    assert adapter.expressible(config) is None
    ec = config.eigenvalue_correction
    assert ec is not None
    cases = {
        "eigenvalue_correction = None": ss.ShampooConfig(),
        "eigenvalue_correction.eigenbasis_method": dataclasses.replace(
            config, eigenvalue_correction=dataclasses.replace(ec, eigenbasis_method="eigh",
                                                              qr_max_iterations=1)),
        "grafting.type": dataclasses.replace(config, grafting=ss.GraftingConfig(type="sgd")),
        "blocking.max_preconditioner_dim": dataclasses.replace(
            config, blocking=dataclasses.replace(config.blocking, max_preconditioner_dim=4)),
        "schedule.period_anchor": dataclasses.replace(
            config, schedule=dataclasses.replace(
                config.schedule, period_anchor=(
                    "end" if config.schedule.period_anchor == "start" else "start"))),
        # One flag for both corrections: the refusal names the one that differs from it.
        "bias_correction": dataclasses.replace(
            config, gradient_filter=dataclasses.replace(
                config.gradient_filter,
                bias_correction=not config.gradient_filter.bias_correction)),
        "weight_decay.type": dataclasses.replace(
            config, weight_decay=ss.WeightDecayConfig(value=0.01, type="direction")),
    }
    for field, bad in cases.items():
        reason = adapter.expressible(bad)
        assert reason is not None and field in reason, (field, reason)
        with pytest.raises(ss.Inexpressible, match=field.split(" ")[0]):
            adapter.soap_kwargs(bad)


def test_arguments_no_config_says_are_refused(adapter: ModuleType) -> None:
    dim = "max_precond_dim" if _library(adapter) == "heavyball" else "max_precondition_dim"
    for kwargs, field in [({"merge_dims": True}, "merge_dims"), ({dim: 2048}, dim),
                          ({"betas": (0.9, 1.0)}, "betas[1]"), ({"eps": 0.0}, "eps"),
                          ({"shampoo_beta": 1.0}, "shampoo_beta")]:
        with pytest.raises(ss.Inexpressible, match=field.replace("[", r"\[")):
            adapter.from_kwargs(kwargs)
    if _library(adapter) == "heavyball":
        with pytest.raises(ss.Inexpressible, match="mars"):
            adapter.from_kwargs({"mars": True})
    else:
        with pytest.raises(ss.Inexpressible, match="normalize_gradient"):
            adapter.from_kwargs({"normalize_gradient": True})


def test_first_step_moves_nothing(adapter: ModuleType) -> None:
    """SOAP's step 1 only initializes (``first_step_skipped``), weight decay included."""
    params, grads = make_problem(FULL_RANK_SHAPES, 2, 0)
    config = adapter.from_kwargs({**PROBE})
    out = adapter.run(config, params, grads)
    for name, w in params.items():
        np.testing.assert_array_equal(out[0][name], w)
        assert not np.array_equal(out[1][name], w)


@pytest.mark.parametrize("frequency", [1, 3, 100])
def test_model_equals_the_library(adapter: ModuleType, frequency: int) -> None:
    """The model with every rule the library's equals the library, 10 steps, float64.

    pytorch-optimizer's QR step is float32 (``float32_qr``): numpy's and torch's
    float32 QR round differently, so where a QR step comes within the 10 steps its
    run agrees to float32 rounding amplified by the bases' conditioning; without
    one (period 100: only the first basis, an eigh) to float64 rounding.
    """
    library = _library(adapter)
    for kwargs in ({**PROBE, "precondition_frequency": frequency},
                   {**PROBE, "precondition_frequency": frequency, "betas": (0.0, 0.99),
                    "shampoo_beta": 0.5, "eps": 1e-8, "weight_decay": 0.0, "lr": 0.01}):
        params, grads = make_problem(FULL_RANK_SHAPES, 10, frequency)
        ours = adapter.run(adapter.from_kwargs(kwargs), params, grads)
        theirs = _model_run(library, params, grads, kwargs, spec=())
        worst = _worst(ours, theirs, params)
        float32 = library == "pytorch-optimizer" and frequency < 10
        assert worst <= (1e-5 if float32 else 1e-12), (kwargs, worst)


@pytest.mark.parametrize("frequency", [1, 3])
def test_model_without_its_deviations_is_the_reference(adapter: ModuleType,
                                                       frequency: int) -> None:
    """Every rule the spec's: the model equals the reference on the adapter's config."""
    library = _library(adapter)
    kwargs = {**PROBE, "precondition_frequency": frequency}
    params, grads = make_problem(FULL_RANK_SHAPES, 10, 0)
    _, ref = bound_and_reference(adapter.from_kwargs(kwargs), params, grads, np.float64)
    ours = _model_run(library, params, grads, kwargs, spec=RULES[library])
    assert _worst(ours, ref, params) <= 1e-12


def test_each_deviation_alone_leaves_the_tolerance(adapter: ModuleType) -> None:
    """The model's rules are exactly the backend's deviations, and each alone (every
    other rule the spec's) takes the trajectory out of the reference's tolerance."""
    library = _library(adapter)
    names = [d.name for d in adapter.DEVIATIONS
             if not d.name.endswith("_crash") and d.name not in USER_RUN_ONLY]
    assert sorted(names) == sorted(RULES[library])
    params, grads = make_problem(FULL_RANK_SHAPES, 10, 0)
    bound, ref = bound_and_reference(adapter.from_kwargs(PROBE), params, grads, np.float64)
    for name in names:
        ours = _model_run(library, params, grads, PROBE,
                          spec=[r for r in RULES[library] if r != name])
        div = first_divergence(ours, ref, params, bound)
        assert div is not None, f"{adapter.BACKEND} {name}: within the tolerance"
        print(f"{adapter.BACKEND} {name}: {_worst(ours, ref, params):.1e} relative "
              f"(first step out: {div.step}; bound rtol {bound.rtol:.1e})")


def test_heavyball_crashes_on_a_single_element_matrix() -> None:
    """DEVIATIONS["single_element_matrix_crash"]: a (1, 1) parameter raises at the first
    refresh step (step 2 with a basis every step); known_crash predicts it; beside a
    (1,) and a () it runs."""
    pytest.importorskip("heavyball")
    from shampoo_conformance.thirdparty import heavyball_soap as hb

    config = hb.from_kwargs({"lr": 0.1, "precondition_frequency": 1})
    params, grads = make_problem({"w": (1, 1)}, 2, 0)
    assert hb.known_crash(config, params, 2) and not hb.known_crash(config, params, 1)
    hb.run(config, params, grads[:1])
    with pytest.raises(ValueError, match="does not match Q length"):
        hb.run(config, params, grads)
    fine, grads = make_problem({"v": (1,), "s": (), "m": (1, 5)}, 3, 0)
    assert hb.known_crash(config, fine, 3) is None
    hb.run(config, fine, grads)
    assert hb.refresh_steps(10, 51) == [11, 20, 30, 40, 51]


def test_heavyball_user_run_at_its_defaults() -> None:
    """heavyball.SOAP(params, lr=0.01) as a user runs it (its DEVIATIONS asserted, so
    the documentation cannot go stale): float64 parameters crash at the first refresh
    (step 2) with its float32 storage; it consumes p.grad; it refuses unknown
    arguments; its default merge_dims=True preconditions (3, 4, 5) as (3, 20)."""
    pytest.importorskip("heavyball")
    hb = importlib.import_module("shampoo_conformance.thirdparty.heavyball_soap")
    names = {d.name for d in hb.DEVIATIONS}
    assert {"float32_storage_crash", "grads_consumed", "merge_dims_default"} <= names
    params, grads = make_problem({"w": (7, 10)}, 2, 0)
    hb.library_run(hb.USER_KWARGS, params, grads[:1], np.float64)
    with pytest.raises(RuntimeError, match="expected scalar type Float but found Double"):
        hb.library_run(hb.USER_KWARGS, params, grads, np.float64)
    run = hb.library_run(hb.USER_KWARGS, params, grads, np.float32)
    assert all(np.isnan(step["w"]).all() for step in run.grads)  # p.grad is None
    with pytest.raises(TypeError, match="not_an_argument"):
        hb.library_run({**hb.USER_KWARGS, "not_an_argument": 1.0}, params, grads)
    for shape, merged in (((3, 4, 5), True), ((7, 10), False)):
        params, grads = make_problem({"t": shape}, 4, 0)
        runs = [hb.library_run({**hb.USER_KWARGS, **kwargs}, params, grads, np.float32)
                for kwargs in ({}, {"merge_dims": False})]
        same = np.array_equal(runs[0].params[-1]["t"], runs[1].params[-1]["t"])
        assert same is not merged, shape
