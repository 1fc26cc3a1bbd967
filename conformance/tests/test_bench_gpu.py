"""The prepared GPU check (``nox -s gpu``, :mod:`shampoo_conformance.bench.gpu`): its
agreement measure on this CPU, on the accelerator path a GPU takes, and that it fails a
wrong optimizer."""

from __future__ import annotations

import dataclasses

import pytest

from shampoo_conformance.bench import gpu
from shampoo_spec import ShampooConfig, from_meta

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("config", [from_meta(gpu.SMALL_META), ShampooConfig()],
                         ids=["meta", "defaults"])
def test_agreement_on_the_accelerator_path_is_within_the_bound(
        config: ShampooConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHAMPOO_TORCH_PATH", "accelerator")
    assert gpu.agreement(config, "cpu") <= gpu.BOUND


def test_agreement_sees_a_wrong_learning_rate() -> None:
    """The measure is not vacuous: ours at a learning rate 1% off is far outside."""
    config = from_meta(gpu.SMALL_META)
    wrong = dataclasses.replace(config, learning_rate=config.learning_rate * 1.01)
    assert gpu.agreement(config, "cpu", ours_config=wrong) > 1e-3
