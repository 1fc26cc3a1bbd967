r"""A seeded Markov source of tokens whose entropy rate is known exactly.

Tokens are ``0 .. V-1``. A source of order ``k`` draws each token from a
distribution that depends only on the previous ``k`` tokens, its *context*,
encoded as the state ``s = sum_j x_{t-k+j} V^(k-1-j)`` (base ``V``, oldest
token first; ``S = V^k`` states)::

    P(x_t = c | x_0 .. x_{t-1}) = T[s_t, c],     s_{t+1} = (s_t V + x_t) mod V^k.

:func:`random_sparse_source` builds ``T`` as a sparse random kernel mixed
with a little uniform noise::

    T[s, :] = (1 - smoothing) * Dirichlet(1, ..., 1) on `branching` random tokens
              + smoothing / V.

Every entry of ``T`` is then at least ``smoothing / V > 0``, so any ``k``
consecutive tokens have positive probability: the chain on states is
irreducible and aperiodic and has a unique stationary distribution ``pi``
(``pi Q = pi`` for the S x S state-transition matrix ``Q``), which
:meth:`MarkovSource.stationary` solves for with one dense linear solve.

The entropy rate (nats per token) of the stationary process is::

    H = lim_t H(x_t | x_0 .. x_{t-1}) = H(x_t | s_t) = - sum_s pi_s sum_c T[s, c] log T[s, c].

Sequences start in the stationary distribution (the first ``k`` tokens are
the digits of ``s_k ~ pi``), so every later token is a stationary draw and
``E[-log T[s_t, x_t]] = H`` exactly at every position ``t >= k``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ._problem import Array, read_only

IntArray = NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class MarkovSource:
    """An order-``order`` Markov kernel ``transition[state, next_token]`` on ``vocab_size`` tokens.

    ``transition`` has shape ``(vocab_size ** order, vocab_size)``, rows
    summing to 1, and ``stationary`` the state distribution ``pi``.
    """

    vocab_size: int
    order: int
    transition: Array
    stationary: Array

    @property
    def num_states(self) -> int:
        return int(self.vocab_size**self.order)

    def entropy_rate(self) -> float:
        """``H = - sum_s pi_s sum_c T[s, c] log T[s, c]`` in nats per token."""
        t = self.transition
        logs = np.log(np.where(t > 0.0, t, 1.0))  # 0 log 0 = 0
        return float(-np.dot(self.stationary, np.sum(t * logs, axis=1)))

    def context_states(self, tokens: IntArray) -> IntArray:
        """The state (encoded previous ``order`` tokens) before each position ``t >= order``.

        ``tokens`` has shape (batch, length); the result has shape
        (batch, length - order) and entry ``[i, t - order]`` encodes
        ``tokens[i, t - order : t]``.
        """
        length = tokens.shape[1]
        states = np.zeros((tokens.shape[0], length - self.order), dtype=np.int64)
        for j in range(self.order):
            states = states * self.vocab_size + tokens[:, j : length - self.order + j]
        return states

    def log_likelihoods(self, tokens: IntArray) -> Array:
        """``log T[s_t, x_t]`` for positions ``t >= order``, shape (batch, length - order)."""
        states = self.context_states(tokens)
        logs = np.log(self.transition[states, tokens[:, self.order :]])
        return np.asarray(logs, dtype=np.float64)

    def sample(self, rng: np.random.Generator, num_sequences: int, length: int) -> IntArray:
        """``num_sequences`` stationary sequences of ``length >= order`` tokens, (n, length)."""
        tokens = np.zeros((num_sequences, length), dtype=np.int64)
        state = rng.choice(self.num_states, size=num_sequences, p=self.stationary)
        remainder = state.copy()
        for j in reversed(range(self.order)):  # the base-V digits of the first state
            tokens[:, j] = remainder % self.vocab_size
            remainder //= self.vocab_size
        cumulative = np.cumsum(self.transition, axis=1)
        for t in range(self.order, length):
            u = rng.random(num_sequences)[:, None] * cumulative[state, -1:]
            token = np.minimum(np.sum(cumulative[state] <= u, axis=1), self.vocab_size - 1)
            tokens[:, t] = token
            state = (state * self.vocab_size + token) % self.num_states
        return tokens


def state_transition_matrix(vocab_size: int, order: int, transition: Array) -> Array:
    """The dense S x S matrix ``Q[s, (s V + c) mod S] = T[s, c]`` of the chain on states."""
    num_states = vocab_size**order
    q = np.zeros((num_states, num_states))
    states = np.arange(num_states)[:, None]
    successors = (states * vocab_size + np.arange(vocab_size)[None, :]) % num_states
    np.add.at(q, (np.broadcast_to(states, successors.shape), successors), transition)
    return q


def stationary_distribution(q: Array) -> Array:
    """The unique ``pi`` with ``pi Q = pi`` and ``sum(pi) = 1`` (``Q`` irreducible).

    Solves the square system ``(Q^T - I) pi = 0`` with its last equation
    replaced by ``1^T pi = 1``; irreducibility makes that system regular.
    """
    num_states = q.shape[0]
    system = q.T - np.eye(num_states)
    system[-1, :] = 1.0
    rhs = np.zeros(num_states)
    rhs[-1] = 1.0
    pi = np.linalg.solve(system, rhs)
    return np.asarray(pi, dtype=np.float64)


def random_sparse_source(
    rng: np.random.Generator, vocab_size: int, order: int, branching: int, smoothing: float
) -> MarkovSource:
    """A random kernel: per state, Dirichlet(1) weights on ``branching`` tokens, plus smoothing."""
    num_states = vocab_size**order
    support = np.argsort(rng.random((num_states, vocab_size)), axis=1)[:, :branching]
    weights = rng.dirichlet(np.ones(branching), size=num_states)
    sparse = np.zeros((num_states, vocab_size))
    np.put_along_axis(sparse, support, weights, axis=1)
    transition = (1.0 - smoothing) * sparse + smoothing / vocab_size
    pi = stationary_distribution(state_transition_matrix(vocab_size, order, transition))
    return MarkovSource(vocab_size, order, read_only(transition), read_only(pi))
