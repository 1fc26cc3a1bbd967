"""Eq. (14c)'s epsilon placement: after the square root (default) or inside it (tearfree)."""

from __future__ import annotations

import numpy as np
import pytest

from shampoo_reference.grafting import direction
from shampoo_spec import GraftingConfig


@pytest.mark.parametrize("kind", ["adagrad", "rmsprop", "adam"])
def test_inside_sqrt_divides_by_sqrt_of_v_plus_epsilon(kind: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3))
    v = rng.uniform(0.0, 2.0, (4, 3))
    beta2 = 1.0 if kind == "adagrad" else 0.9
    eps = 0.25
    inside = GraftingConfig(type=kind, beta2=beta2, epsilon=eps, epsilon_placement="inside_sqrt",
                            bias_correction=kind == "adam")
    after = GraftingConfig(type=kind, beta2=beta2, epsilon=eps, bias_correction=kind == "adam")
    bc = 1.0 - 0.9**3 if kind == "adam" else 1.0
    np.testing.assert_allclose(direction(x, v, 3, inside), x / np.sqrt(v / bc + eps), rtol=1e-15)
    np.testing.assert_allclose(direction(x, v, 3, after), x / (np.sqrt(v / bc) + eps), rtol=1e-15)
    # The placements differ unless sqrt(v + e) = sqrt(v) + e, i.e. v = ((1 - e) / 2)^2.
    assert np.all(direction(x, v, 3, inside) != direction(x, v, 3, after))


def test_inside_sqrt_needs_an_adaptive_graft() -> None:
    with pytest.raises(ValueError, match=r"grafting\.epsilon_placement = 'inside_sqrt' is invalid"):
        GraftingConfig(type="sgd", epsilon_placement="inside_sqrt")
    with pytest.raises(ValueError, match=r"grafting\.epsilon_placement = 'middle' is invalid"):
        GraftingConfig(type="adagrad", epsilon_placement="middle")  # type: ignore[arg-type]
