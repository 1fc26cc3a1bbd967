"""Contract 8.2: the backend registry and the reference backend."""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import replace

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_conformance import BackendUnavailable, get_backend
from shampoo_conformance.thirdparty.registry import Deviation, deviation_for, nearest_config


def test_reference_run_returns_params_after_each_step() -> None:
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((3, 4)), "s": np.array(0.5), "b": np.zeros(3)}
    grads = [{k: rng.standard_normal(v.shape) for k, v in params.items()} for _ in range(3)]
    out = get_backend("reference").run(ss.ShampooConfig(), params, grads)
    assert len(out) == 3
    for step in out:
        assert {k: v.shape for k, v in step.items()} == {k: v.shape for k, v in params.items()}
    assert not np.allclose(out[0]["w"], params["w"])


def test_trajectory_equals_run_on_the_same_gradients() -> None:
    backend = get_backend("reference")
    cfg = ss.ShampooConfig(grafting=ss.GraftingConfig(type="adagrad"))
    p0 = {"w": np.ones((2, 3))}
    traj = backend.trajectory(cfg, p0, lambda p: {"w": np.sin(3 * p["w"]) + 0.1}, 4)
    grads = [{"w": np.sin(3 * p["w"]) + 0.1} for p in [p0, *traj[:-1]]]
    replay = backend.run(cfg, p0, grads)
    for a, b in zip(traj, replay, strict=True):
        np.testing.assert_array_equal(a["w"], b["w"])


def test_reference_rejects_float32() -> None:
    with pytest.raises(ValueError, match="float64"):
        get_backend("reference").run(ss.ShampooConfig(), {"w": np.ones(2)}, [], dtype=np.float32)


def test_unknown_backend_lists_choices() -> None:
    with pytest.raises(ValueError, match="reference"):
        get_backend("nope")


def test_third_party_backend_by_path(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("my_shampoo_backend")

    class Mine:
        name = "mine"

        def run(self, config, params, grads, dtype=np.float64):  # type: ignore[no-untyped-def]
            return [dict(params) for _ in grads]

    module.make = Mine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "my_shampoo_backend", module)
    backend = get_backend("my_shampoo_backend:make")
    assert backend.run(ss.ShampooConfig(), {"w": np.ones(1)}, [{}, {}])[1]["w"][0] == 1.0
    with pytest.raises(ValueError, match="nothere"):
        get_backend("my_shampoo_backend:nothere")
    with pytest.raises(BackendUnavailable):
        get_backend("no_such_module_xyz:make")


def test_uninstalled_library_backend_names_its_install_command() -> None:
    """Contract 8.2: a third-party library that is not installed is reported with the
    command that installs it (here: the tests session does not install Meta's)."""
    pytest.importorskip("torch")
    if importlib.util.find_spec("distributed_shampoo") is not None:
        pytest.skip("Meta's library is installed here")
    with pytest.raises(BackendUnavailable, match=r"pip install .*torch-shampoo-f606606"):
        get_backend("meta")


def test_deviation_patterns_match_bracketed_test_ids() -> None:
    """fnmatch reads "[" as a character class; a deviation's patterns take it literally."""
    found = Deviation(name="d", config=ss.ShampooConfig(), cause="c", kind="design",
                      tests=("test_named_case_float64[meta_preset]", "test_laws[*-adam]"))
    assert found.covers("test_named_case_float64[meta_preset]")
    assert found.covers("test_laws[0.9-adam]")
    assert not found.covers("test_named_case_float64[m]")
    assert not found.covers("test_named_case_float64[meta_preset_2]")
    assert deviation_for((found,), "test_laws[0.9-sgd]") is None


def test_exporters_refuse_with_inexpressible_naming_the_field() -> None:
    """A third-party backend skips exactly the configs the exporter cannot write."""
    config = ss.ShampooConfig(epsilon=ss.EpsilonConfig(value=1e-3, scale="relative"))
    with pytest.raises(ss.Inexpressible, match=r"epsilon\.scale = 'relative'"):
        ss.to_meta(config)
    assert issubclass(ss.Inexpressible, ValueError)


class _AbsoluteOnly:
    """A library that has no relative epsilon, and grafts only with Adam at beta2 0.999."""

    def base_config(self) -> ss.ShampooConfig:
        return ss.ShampooConfig(learning_rate=0.5)

    def expressible(self, config: ss.ShampooConfig, dtype: object = np.float64) -> str | None:
        if config.epsilon.scale != "absolute":
            return "epsilon.scale: absolute only"
        graft = config.grafting
        if graft.type not in ("none", "adam") or (graft.type == "adam" and graft.beta2 != 0.999):
            return "grafting: none or Adam(0.999) only"
        return None


def test_nearest_config_keeps_what_the_library_expresses_and_lists_the_rest() -> None:
    """The report runs a library on the nearest config it expresses and says what changed:
    a section taken whole (the graft's type and beta2 together), single values kept
    (epsilon's value without its relative scale)."""
    want = ss.ShampooConfig(
        learning_rate=0.1,
        epsilon=ss.EpsilonConfig(value=1e-6, scale="relative"),
        grafting=ss.GraftingConfig(type="adam", beta2=0.999, bias_correction=True),
    )
    nearest, changed = nearest_config(_AbsoluteOnly(), want)
    assert nearest == replace(want, epsilon=ss.EpsilonConfig(value=1e-6))
    assert changed == ["epsilon.scale: 'relative' -> 'absolute'"]
    assert nearest_config(_AbsoluteOnly(), nearest) == (nearest, [])
    assert nearest_config(get_backend("reference"), want) == (want, [])
