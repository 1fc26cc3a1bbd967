"""The Markov source: stationary distribution, entropy rate, sampler, corpus floors."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from shampoo_datasets import load_problem
from shampoo_datasets.language_model import SMOOTHING, prefix_conditional_entropy
from shampoo_datasets.markov_source import (
    MarkovSource,
    random_sparse_source,
    state_transition_matrix,
)


def _source(vocab_size: int, order: int, seed: int = 0) -> MarkovSource:
    return random_sparse_source(np.random.default_rng(seed), vocab_size, order, 3, SMOOTHING)


@pytest.mark.parametrize(("vocab_size", "order"), [(16, 1), (6, 2), (4, 3)])
def test_kernel_and_stationary_distribution(vocab_size: int, order: int) -> None:
    """Rows are distributions with entries >= smoothing / V; pi Q = pi by power iteration too.

    The solve is backward stable: ||pi Q - pi|| ~ u S; 1e-13 is loose. Power
    iteration from uniform converges geometrically (the chain mixes in a few
    steps here), so 2000 iterations reach round-off.
    """
    source = _source(vocab_size, order)
    t = source.transition
    assert t.shape == (vocab_size**order, vocab_size)
    np.testing.assert_allclose(t.sum(axis=1), 1.0, rtol=1e-14)
    assert t.min() >= SMOOTHING / vocab_size * (1 - 1e-12)
    assert np.all(np.sum(t > 2 * SMOOTHING / vocab_size, axis=1) <= 3)  # sparse support
    q = state_transition_matrix(vocab_size, order, t)
    pi = source.stationary
    assert pi.min() > 0.0 and pi.sum() == pytest.approx(1.0, rel=1e-14)
    np.testing.assert_allclose(pi @ q, pi, atol=1e-13)
    iterate = np.full(pi.size, 1.0 / pi.size)
    for _ in range(2000):
        iterate = iterate @ q
    np.testing.assert_allclose(iterate, pi, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(("vocab_size", "order"), [(16, 1), (6, 2)])
def test_entropy_rate_is_the_block_entropy_difference(vocab_size: int, order: int) -> None:
    """H = H(x_0 .. x_k) - H(x_0 .. x_{k-1}) for a stationary order-k chain (k-blocks ~ pi)."""
    source = _source(vocab_size, order)
    pi, t = source.stationary, source.transition
    joint = pi[:, None] * t  # P(block of k + 1 tokens) = pi(first k) T(last | first k)
    block_k_plus_1 = -float(np.sum(joint * np.log(joint)))
    block_k = -float(np.sum(pi * np.log(pi)))
    assert source.entropy_rate() == pytest.approx(block_k_plus_1 - block_k, rel=1e-12)
    assert 0.0 < source.entropy_rate() < np.log(vocab_size)


@pytest.mark.parametrize("order", [1, 2])
def test_sampled_text_has_the_entropy_rate(order: int) -> None:
    """Monte Carlo: the mean of -log T[s_t, x_t] over sampled text is H within 5 standard errors.

    Sequences are independent, so their per-sequence means are i.i.d. and the
    standard error is their standard deviation / sqrt(number of sequences).
    Also the sampler is stationary: the state frequencies at the first and
    the last counted position match pi within 5 binomial standard errors.
    """
    source = _source(6, order, seed=1)
    rng = np.random.default_rng(2)
    sequences = 4000
    tokens = source.sample(rng, sequences, 16)
    per_sequence = -source.log_likelihoods(tokens).mean(axis=1)
    standard_error = per_sequence.std(ddof=1) / np.sqrt(sequences)
    assert abs(per_sequence.mean() - source.entropy_rate()) < 5 * standard_error
    states = source.context_states(tokens)
    pi = source.stationary
    bound = 5 * np.sqrt(pi * (1 - pi) / sequences)
    for column in (0, -1):
        frequency = np.bincount(states[:, column], minlength=pi.size) / sequences
        assert np.all(np.abs(frequency - pi) < bound + 1e-12)


def test_corpus_floors_of_the_problem() -> None:
    """The kernel's corpus loss is H within noise; the corpus infimum is below it."""
    problem = load_problem("markov_transformer")
    # H bounds the expected loss on fresh text, not this training loss (the
    # model can memorize the corpus), so the training minimum is unknown.
    assert problem.loss_floor is None
    entropy_rate = float(problem.data["entropy_rate"])
    transition = problem.data["transition"]
    tokens = problem.data["tokens"].astype(np.int64)
    source = MarkovSource(16, 2, transition, problem.data["stationary"])
    assert entropy_rate == pytest.approx(source.entropy_rate(), rel=1e-15)
    per_sequence = -source.log_likelihoods(tokens).mean(axis=1)
    bayes = float(problem.data["corpus_bayes_loss"])
    assert bayes == pytest.approx(per_sequence.mean(), rel=1e-14)
    standard_error = per_sequence.std(ddof=1) / np.sqrt(tokens.shape[0])
    assert abs(bayes - entropy_rate) < 5 * standard_error
    assert problem.target_loss == bayes
    assert float(problem.data["corpus_infimum"]) < bayes


def test_heldout_loss_is_measured_on_fresh_source_text() -> None:
    """The held-out text is the source's (its kernel loss is H within noise), it
    differs from the corpus, and no model beats H on it beyond sampling noise."""
    problem = load_problem("markov_transformer")
    source = MarkovSource(
        16, 2, problem.data["transition"], problem.data["stationary"]
    )
    heldout = problem.data["heldout_tokens"].astype(np.int64)
    assert heldout.shape[1] == problem.data["tokens"].shape[1]
    assert not np.array_equal(heldout[: problem.data["tokens"].shape[0]], problem.data["tokens"])
    per_sequence = -source.log_likelihoods(heldout).mean(axis=1)
    standard_error = per_sequence.std(ddof=1) / np.sqrt(heldout.shape[0])
    entropy_rate = float(problem.data["entropy_rate"])
    assert abs(per_sequence.mean() - entropy_rate) < 5 * standard_error
    assert problem.metrics is not None
    heldout_loss = problem.metrics(problem.copy_init_params())["heldout_loss"]
    assert heldout_loss > entropy_rate - 5 * standard_error


def _brute_force_infimum(tokens: np.ndarray, first: int) -> float:
    counts: dict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
    for row in tokens:
        for t in range(first, len(row)):
            counts[tuple(row[:t])][int(row[t])] += 1
    total = 0.0
    for counter in counts.values():
        n = np.array(list(counter.values()), dtype=np.float64)
        total -= float(np.sum(n * np.log(n / n.sum())))
    return total / (tokens.shape[0] * (tokens.shape[1] - first))


def test_prefix_conditional_entropy_matches_brute_force_and_bounds_the_loss() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 3, size=(40, 5))
    for first in (1, 2):
        assert prefix_conditional_entropy(tokens, first) == pytest.approx(
            _brute_force_infimum(tokens, first), rel=1e-13
        )
    problem = load_problem(
        "markov_transformer", vocab_size=4, sequence_length=5, num_sequences=60, d_model=8
    )
    infimum = float(problem.data["corpus_infimum"])
    assert 0.0 < infimum < float(problem.data["corpus_bayes_loss"])
    for scale in (0.0, 1.0, 3.0):  # every model is a causal predictor: loss >= infimum
        point = {
            k: v + scale * rng.standard_normal(v.shape) for k, v in problem.init_params.items()
        }
        assert problem.loss(point) >= infimum
