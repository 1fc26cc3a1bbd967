"""The NumPy transformer of markov_transformer: exact backward pass, causality, start."""

from __future__ import annotations

import numpy as np
import pytest

from shampoo_datasets import load_problem
from shampoo_datasets.transformer import (
    TransformerShape,
    gelu,
    gelu_derivative,
    loss_and_grad,
)

from .helpers import SMALL_OPTIONS, adam, random_point


@pytest.mark.parametrize("layers", [1, 2])
def test_every_gradient_entry_matches_central_differences(layers: int) -> None:
    """Entry by entry, per tensor: ||g_numeric - g|| <= 1e-6 ||g||.

    With h = 1e-5 the central difference errs by h^2 |f'''| / 6 (about 1e-11
    here) plus u |f| / h (about 2e-11) per entry, against gradient entries of
    order 1e-2: far below the 1e-6 bound, which a wrong term would break.
    """
    options = {**SMALL_OPTIONS["markov_transformer"], "layers": layers, "num_sequences": 3}
    problem = load_problem("markov_transformer", seed=1, **options)
    x = random_point(problem, np.random.default_rng(0), scale=0.3)
    grad = problem.grad(x)
    h = 1e-5
    for key, value in x.items():
        numeric = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            shifted = value.copy()
            shifted[index] = value[index] + h
            plus = problem.loss({**x, key: shifted})
            shifted[index] = value[index] - h
            minus = problem.loss({**x, key: shifted})
            numeric[index] = (plus - minus) / (2 * h)
        error = np.linalg.norm(numeric - grad[key]) / np.linalg.norm(grad[key])
        assert error < 1e-6, key


def test_gelu_derivative_matches_central_differences() -> None:
    u = np.linspace(-8.0, 8.0, 1601)
    h = 1e-6
    numeric = (gelu(u + h) - gelu(u - h)) / (2 * h)
    np.testing.assert_allclose(gelu_derivative(u), numeric, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(
        gelu(u),
        0.5 * u * (1 + np.tanh(0.7978845608 * (u + 0.044715 * u**3))),
        rtol=1e-9,
        atol=1e-12,
    )


def test_predictions_never_see_later_tokens() -> None:
    shape = TransformerShape(vocab_size=7, context=9, d_model=8, heads=2, layers=2)
    rng = np.random.default_rng(0)
    params = {k: v + 0.3 * rng.standard_normal(v.shape) for k, v in shape.init_params(rng).items()}
    inputs = rng.integers(0, 7, size=(3, 9))
    targets = rng.integers(0, 7, size=(3, 9))
    weights = np.ones(9)
    _, _, logits = loss_and_grad(shape, params, inputs, targets, weights, with_grad=False)
    for position in range(9):
        changed = inputs.copy()
        changed[:, position] = (changed[:, position] + 1) % 7
        _, _, other = loss_and_grad(shape, params, changed, targets, weights, with_grad=False)
        np.testing.assert_array_equal(other[:, :position], logits[:, :position])
        assert np.abs(other[:, position] - logits[:, position]).max() > 1e-6


def test_start_is_near_uniform_and_zero_output_gives_log_vocab() -> None:
    problem = load_problem("markov_transformer")
    start = problem.loss(problem.init_params)
    assert start == pytest.approx(np.log(16.0), abs=0.1)
    zero = {
        **problem.copy_init_params(),
        "unembedding": np.zeros((32, 16)),
        "unembedding_bias": np.zeros(16),
    }
    assert problem.loss(zero) == pytest.approx(np.log(16.0), rel=1e-14)
    assert problem.metrics is not None
    assert problem.metrics(zero)["bits_per_token"] == pytest.approx(4.0, rel=1e-14)


def test_parameter_shapes_and_data_independent_of_the_model() -> None:
    problem = load_problem("markov_transformer")
    shapes = {k: v.shape for k, v in problem.init_params.items()}
    assert shapes["token_embedding"] == (16, 32)
    assert shapes["position_embedding"] == (23, 32)
    assert shapes["block0.attention.query"] == (32, 32)
    assert shapes["block0.mlp.hidden_weight"] == (32, 128)
    assert shapes["unembedding"] == (32, 16)
    assert len(shapes) == 18
    assert problem.data["tokens"].shape == (64, 24)
    wider = load_problem("markov_transformer", d_model=16, heads=4, layers=2)
    for key in ("tokens", "transition", "corpus_bayes_loss"):
        np.testing.assert_array_equal(problem.data[key], wider.data[key])
    assert wider.loss_floor == problem.loss_floor


def test_default_target_reached_by_adam_as_documented() -> None:
    """Documented: Adam at step 1e-2 reaches the source's own corpus loss in about 40 steps."""
    problem = load_problem("markov_transformer")
    losses = adam(problem, 1e-2, 50)
    assert problem.target_loss is not None
    assert min(losses) <= problem.target_loss
    assert losses[19] > problem.target_loss
