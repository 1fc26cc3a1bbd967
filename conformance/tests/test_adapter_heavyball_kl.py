"""The heavyball KL backends (``heavyball-klshampoo``, ``heavyball-klsoap``): translation,
KLShampoo written down exactly (kl_model.py), and what a user's run shows.

KLShampoo: the model with every rule on equals the library (so the reading is complete),
with every rule off equals the reference on the config the adapter maps the arguments to
(so the mapping is right and nothing else differs), and each rule alone takes the
reference out of its tolerance (the sizes printed are docs/third-party.md's). KLSOAP: no
config expresses it (the spec refuses eq. 6b with eq. 17); it equals heavyball's SOAP
where it takes no KL statistics and differs where it does.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("heavyball")

import heavyball  # noqa: E402
import torch  # noqa: E402

import shampoo_spec as ss  # noqa: E402
from shampoo_conformance.adapters.torch_user_run import torch_library_run  # noqa: E402
from shampoo_conformance.backends import get_backend  # noqa: E402
from shampoo_conformance.suite import user_runs  # noqa: E402
from shampoo_conformance.suite.cases import make_problem  # noqa: E402
from shampoo_conformance.suite.divergence import first_divergence  # noqa: E402
from shampoo_conformance.suite.tolerances import bound_and_reference  # noqa: E402
from shampoo_conformance.thirdparty import heavyball_klshampoo as ks  # noqa: E402
from shampoo_conformance.thirdparty import heavyball_klsoap as ksoap  # noqa: E402
from shampoo_conformance.thirdparty.soap import FULL_RANK_SHAPES, NO_DIM_LIMIT  # noqa: E402


def _load_model() -> Any:
    """kl_model.py beside this file (the tests run with --import-mode=importlib, so the
    directory is not on sys.path)."""
    spec = importlib.util.spec_from_file_location("kl_model", Path(__file__).with_name(
        "kl_model.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kl_model", module)
    spec.loader.exec_module(module)
    return module


_MODEL = _load_model()
RULES: tuple[str, ...] = _MODEL.RULES
model = _MODEL.model

#: Arguments that show every rule within 10 steps: an epsilon large enough to show, betas
#: not exact in float32, weight decay.
PROBE = {"lr": 0.1, "betas": (0.9, 0.95), "shampoo_beta": 0.9, "eps": 1e-6,
         "weight_decay": 0.1}
#: Full-rank shapes (soap.FULL_RANK_SHAPES) and a non-square matrix with full-rank factors.
SHAPES = {**FULL_RANK_SHAPES, "wide": (4, 3)}


def _model_run(params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]],
               kwargs: dict[str, Any], spec: Any = ()) -> list[dict[str, np.ndarray]]:
    k = {**PROBE, **kwargs}
    per = {name: model(w, [g[name] for g in grads], lr=k["lr"], beta1=k["betas"][0],
                       shampoo_beta=k["shampoo_beta"], eps=k["eps"],
                       weight_decay=k["weight_decay"], frequency=k["precondition_frequency"],
                       precondition_1d=k.get("precondition_1d", False),
                       init_factor=k.get("init_factor", 0.0), spec=spec)
           for name, w in params.items()}
    return [{name: per[name][t] for name in params} for t in range(len(grads))]


def _library(params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]],
             kwargs: dict[str, Any], cls: Any = heavyball.KLShampoo,
             dtype: Any = np.float64) -> list[dict[str, np.ndarray]]:
    """The library with the backend's fixed arguments (nothing merged, no dim limit, state
    in the parameters' dtype, no noise unless ``kwargs`` says)."""
    fixed = {"merge_dims": False, "max_precond_dim": NO_DIM_LIMIT,
             "storage_dtype": np.dtype(dtype).name}
    if cls is heavyball.KLShampoo:
        fixed["dampening"] = 0.0
    with torch.random.fork_rng(devices=[]):  # the noise, if any, leaves the caller's stream
        torch.manual_seed(0)
        return torch_library_run(lambda ps, kw: cls(ps, **kw), {**fixed, **kwargs},
                                 params, grads, dtype).params


def _worst(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> float:
    return max(float(np.max(np.abs(x[n] - y[n]), initial=0.0)) for x, y in zip(a, b, strict=True)
               for n in x)


# ------------------------------------------------------------ KLShampoo, read exactly
@pytest.mark.parametrize("frequency", [1, 3])
@pytest.mark.parametrize("init_factor", [0.0, 0.1])
def test_model_with_every_rule_is_the_library(frequency: int, init_factor: float) -> None:
    """The model equals heavyball.KLShampoo to rounding (float64, 10 steps), matrices,
    tensors and vectors, with init_factor 0 (the backend's) and 0.1 (the default)."""
    params, grads = make_problem(SHAPES, 10, 0)
    kwargs = {**PROBE, "precondition_frequency": frequency, "init_factor": init_factor}
    assert _worst(_library(params, grads, kwargs), _model_run(params, grads, kwargs)) < 1e-11


def test_model_preconditions_vectors_as_the_library() -> None:
    """precondition_1d: a vector's factor (rank-deficient from G_1, so from init_factor I)."""
    params, grads = make_problem({"vector": (7,), "square": (5, 5)}, 10, 0)
    kwargs = {**PROBE, "precondition_frequency": 1, "init_factor": 0.1, "precondition_1d": True}
    assert _worst(_library(params, grads, kwargs), _model_run(params, grads, kwargs)) < 1e-11


def test_backend_runs_the_library_as_the_model() -> None:
    """``run`` (init_factor 0, no noise) on a named case is the model's trajectory."""
    params, grads = make_problem(FULL_RANK_SHAPES, 8, 1)
    config = ks.CASES["period_4"]
    kwargs = ks.kl_kwargs(config)
    assert _worst(ks.run(config, params, grads), _model_run(params, grads, kwargs)) < 1e-11


@pytest.mark.parametrize("frequency", [1, 2, 3])
def test_model_without_its_rules_is_the_reference(frequency: int) -> None:
    """Every rule switched to the spec's: the reference on from_kwargs(...), within the
    suite's bound: the mapping is right and nothing else differs."""
    params, grads = make_problem(SHAPES, 10, 0)
    kwargs = {**PROBE, "precondition_frequency": frequency}
    config = ks.from_kwargs(kwargs)
    bound, ref = bound_and_reference(config, params, grads, np.float64)
    assert first_divergence(_model_run(params, grads, kwargs, RULES), ref, params, bound) is None


#: The period each rule needs to show (eigenvalues between refreshes, the rounded sum).
_FREQUENCY = {"eigenvalues_every_step": 2, "precondition_schedule_rounding": 3}


@pytest.mark.parametrize("rule", [r for r in RULES if r != "init_factor_identity"])
def test_each_rule_alone_leaves_the_reference(rule: str) -> None:
    """Each deviation alone takes the model out of the reference's tolerance; the size
    printed is the one docs/third-party.md reports (PROBE, SHAPES, 10 steps)."""
    # Full-rank shapes only: a rank-deficient first factor widens the bound (section 5).
    params, grads = make_problem(FULL_RANK_SHAPES, 10, 0)
    kwargs = {**PROBE, "precondition_frequency": _FREQUENCY.get(rule, 1)}
    bound, ref = bound_and_reference(ks.from_kwargs(kwargs), params, grads, np.float64)
    ours = _model_run(params, grads, kwargs, set(RULES) - {rule})
    div = first_divergence(ours, ref, params, bound)
    assert div is not None, rule
    print(f"{rule}: {div.describe().splitlines()[0]} max |W - W_ref| {_worst(ours, ref):.2e}")


def test_init_factor_and_dampening_move_the_library() -> None:
    """The default init_factor 0.1 (G_1 discarded, 0.1 I in its place) and the default
    dampening (noise in the statistics) each move the library's float64 trajectory."""
    params, grads = make_problem(FULL_RANK_SHAPES, 10, 0)
    kwargs = {**PROBE, "precondition_frequency": 1, "init_factor": 0.0}
    base = _library(params, grads, kwargs)
    init = _worst(_library(params, grads, {**kwargs, "init_factor": 0.1}), base)
    noise = _worst(_library(params, grads, {**kwargs, "dampening": 1e-9}), base)
    print(f"init_factor 0.1: {init:.2e}; dampening 1e-9: {noise:.2e}")
    assert init > 1e-3 and 1e-12 < noise < 1e-4


def test_factor_balance_reweights_a_tensors_plain_statistics() -> None:
    """Without psgd_balance_Q the model leaves the library on an order-3 tensor (plain
    outer products do not scale with the balanced factors): the size docs report."""
    params, grads = make_problem({"tensor": (3, 4, 5)}, 10, 0)
    kwargs = {**PROBE, "precondition_frequency": 1, "init_factor": 0.0}
    size = _worst(_library(params, grads, kwargs),
                  _model_run(params, grads, kwargs, {"factor_balance"}))
    print(f"factor_balance on (3, 4, 5) with the library's other rules: {size:.2e}")
    assert size > 1e-6


# ----------------------------------------------------------------- translation
def test_cases_import_and_export() -> None:
    """Each named case: expressible, and the kwargs the backend passes import to it."""
    for name, config in ks.CASES.items():
        assert ks.expressible(config) is None, name
        assert ks.from_kwargs(ks.kl_kwargs(config)) == config, name


def test_named_cases_show_the_first_step_skipped() -> None:
    """Each named case: at step 1 the library leaves every parameter as it was, bit for
    bit, where the reference moves it (DEVIATIONS["first_step_skipped"]). Compared
    directly, not through the bound: a vector's factor has rank 1 at step 1, where
    eq. (10f)'s bound promises nothing (spec section 5)."""
    params, grads = make_problem(FULL_RANK_SHAPES, 1, 0)
    for name, config in ks.CASES.items():
        _, ref = bound_and_reference(config, params, grads, np.float64)
        library = ks.run(config, params, grads)[0]
        for p, w in params.items():
            assert np.array_equal(library[p], w), (name, p)
            moved = float(np.linalg.norm(ref[0][p] - w))
            assert moved > 1e-6 * (1.0 + float(np.linalg.norm(w))), (name, p, moved)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"merge_dims": True}, "merge_dims"),
    ({"max_precond_dim": 8}, "max_precond_dim"),
    ({"dampening": 1e-9}, "dampening"),
    ({"caution": True}, "caution"),
    ({"shampoo_beta": 1.0}, "shampoo_beta"),
    ({"eps": 0.0}, "eps"),
])
def test_refusals_name_the_argument(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ss.Inexpressible, match=field):
        ks.from_kwargs(kwargs)


@pytest.mark.parametrize(("change", "field"), [
    ({"statistics": ss.StatisticsConfig(beta2=0.95, bias_correction=True)}, "statistics.kl"),
    ({"schedule": ss.ScheduleConfig(start_preconditioning_step=1)}, "roots_take_effect"),
    ({"root_inverse": ss.EighConfig()}, "eigenbasis_method"),
])
def test_configs_refused_name_the_field(change: dict[str, Any], field: str) -> None:
    reason = ks.expressible(dataclasses.replace(ks.base_config(), **change))
    assert reason is not None and field in reason


def test_defaults_config_is_the_defaults_arguments() -> None:
    c = ks.defaults_config()
    assert (c.learning_rate, c.schedule.precondition_frequency, c.weight_decay.value) == (
        3e-3, 2, 0.01)
    assert c.statistics.kl and c.statistics.beta2 == 0.95


# ---------------------------------------------------------------------- KLSOAP
def test_klsoap_combination_is_refused_by_the_spec() -> None:
    """The spec's validation refuses statistics.kl with eigenvalue_correction, and the
    backend refuses every config with that reason (naming both fields)."""
    with pytest.raises(ValueError, match="statistics.kl"):
        ss.ShampooConfig(statistics=ss.StatisticsConfig(kl=True),
                         eigenvalue_correction=ss.EigenvalueCorrectionConfig())
    for config in (ksoap.base_config(), ksoap.defaults_config(), ss.ShampooConfig()):
        reason = ksoap.expressible(config)
        assert reason is not None and "statistics.kl" in reason
        assert "eigenvalue_correction" in reason
    with pytest.raises(ss.Inexpressible, match="statistics.kl"):
        ksoap.run(ksoap.base_config(), {"w": np.zeros(3)}, [{"w": np.ones(3)}])


def test_klsoap_is_soap_except_on_matrices() -> None:
    """Vectors and order-3 tensors take SOAP's statistics (utils.py:1275-1279): KLSOAP is
    heavyball.SOAP bit for bit there (at eps = 1e-8: KLSOAP's QR floor is eps,
    chainable.py:1339, SOAP's a fixed 1e-8); a matrix takes the KL statistics and differs."""
    params, grads = make_problem({"vector": (7,), "tensor": (3, 4, 5), "square": (5, 5)}, 8, 0)
    kwargs = {**PROBE, "eps": 1e-8, "precondition_frequency": 1}
    a = _library(params, grads, kwargs, heavyball.KLSOAP)
    b = _library(params, grads, kwargs, heavyball.SOAP)
    for t in range(len(grads)):
        for name in ("vector", "tensor"):
            assert np.array_equal(a[t][name], b[t][name]), (t, name)
    size = max(float(np.max(np.abs(x["square"] - y["square"]))) for x, y in zip(a, b, strict=True))
    print(f"KLSOAP vs SOAP on a 5 x 5 matrix: {size:.2e}")
    assert size > 1e-4


# ------------------------------------------------------------- a user's run
@pytest.mark.parametrize("name", ["heavyball-klshampoo", "heavyball-klsoap"])
def test_user_run_float64_crashes_at_step_2(name: str) -> None:
    """The default storage_dtype='float32' with float64 parameters: step 1 runs, step 2
    raises (DEVIATIONS["float32_storage_crash"])."""
    module = ks if name == "heavyball-klshampoo" else ksoap
    params, grads = make_problem(user_runs.SHAPES, 2, 0)
    module.library_run(module.USER_KWARGS, params, grads[:1], np.float64)
    with pytest.raises(RuntimeError, match="expected scalar type"):
        module.library_run(module.USER_KWARGS, params, grads, np.float64)


@pytest.mark.parametrize("cls", [heavyball.KLShampoo, heavyball.KLSOAP, heavyball.SOAP])
def test_scalar_parameter_crashes_with_merge_dims(cls: Any) -> None:
    """A 0-d parameter at the default merge_dims=True raises IndexError in dim_merger
    (utils.py:272; DEVIATIONS["scalar_parameter_crash"]); with merge_dims=False it runs."""
    params, grads = {"s": np.array(1.5)}, [{"s": np.array(0.3)}, {"s": np.array(-0.2)}]
    with pytest.raises(IndexError):
        torch_library_run(lambda ps, kw: cls(ps, **kw), {}, params, grads, np.float32)
    torch_library_run(lambda ps, kw: cls(ps, **kw), {"merge_dims": False}, params, grads,
                      np.float32)


@pytest.mark.parametrize("name", ["heavyball-klshampoo", "heavyball-klsoap"])
def test_user_run_checks_fail_exactly_where_documented(name: str) -> None:
    """The suite's user-run checks (suite/user_runs.py) on the backend: the ones that fail
    are the ones its DEVIATIONS cover, and no other (a skip counts as neither)."""
    backend = get_backend(name)
    failed, passed = set(), set()
    for test_id, check in user_runs.CHECKS.items():
        try:
            with torch.random.fork_rng(devices=[]):  # KLShampoo draws from torch's stream
                check(backend)
        except AssertionError:
            failed.add(test_id)
        except pytest.skip.Exception:
            continue
        else:
            passed.add(test_id)
    covered = {t for t in user_runs.CHECKS
               if any(d.covers(t) for d in backend.deviations)}  # type: ignore[attr-defined]
    print(f"{name}: fails {sorted(failed)}; passes {sorted(passed)}")
    assert failed <= covered and not (passed & covered), (failed, passed, covered)
    assert "test_side_effect_unknown_argument_refused" in passed
