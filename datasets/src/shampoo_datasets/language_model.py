r"""A small transformer language model on text from a seeded Markov source.

Data: ``num_sequences`` sequences of ``sequence_length`` tokens drawn from
a random order-``order`` Markov source on ``vocab_size`` tokens (see
:mod:`.markov_source`: each context allows ``branching`` likely next
tokens, plus ``SMOOTHING`` uniform noise), each started in the stationary
distribution. Everything (source, corpus, start) is generated from
``seed`` through independent streams, so the data do not depend on the model
options.

Model: the decoder-only transformer of :mod:`.transformer` (token and
learned position embeddings, ``layers`` pre-norm blocks of ``heads``-head
causal self-attention and a GELU MLP of width ``4 d_model``, final layer
norm, untied output projection) reads tokens ``0 .. L-2`` of each sequence
and predicts tokens ``1 .. L-1``.

Loss: the mean next-token cross-entropy (nats) over the predictions of the
tokens at positions ``t >= order`` (``L - order`` per sequence), i.e. those
whose full Markov context is inside the sequence.

Floor: the source's entropy rate ``H`` (nats/token, ``data["entropy_rate"]``)
is a *population* floor: for positions ``t >= order`` the Bayes-optimal predictor
given the whole past is the kernel ``T[s_t, .]`` itself (the Markov
property), and its expected loss on fresh text is exactly ``H`` (the
sequences start in the stationary distribution). Every predictor has
expected loss ``>= H`` on fresh text; a transformer whose context covers the
previous ``order`` tokens can represent the kernel arbitrarily well and so
approach ``H`` there.

On the finite training corpus two other numbers matter, both in ``data``:

* ``corpus_bayes_loss``: the true kernel's loss on this corpus. It differs
  from ``H`` by sampling noise, of standard deviation about
  ``sd(log T[s_t, x_t]) / sqrt(number of predicted tokens)`` (a few
  hundredths of a nat at the default sizes; ``0.956`` against ``H = 0.968``
  for seed 0).
* ``corpus_infimum``: the exact infimum of the training loss over *all*
  causal predictors, the prefix-conditional empirical entropy
  ``-(1/N) sum_t sum_(prefix, c) n(prefix, c) log(n(prefix, c) / n(prefix))``
  over the distinct prefixes ``x_0 .. x_{t-1}`` of the corpus. A predictor's
  output at position ``t`` is a function of that prefix, so by Gibbs'
  inequality ``loss(theta) >= corpus_infimum`` for every ``theta``.

With sequences of 24 tokens almost every prefix is unique, so at the default
sizes this infimum is far below ``H`` (0.018 for seed 0): 1472 predicted
tokens are too few to learn 256 order-2 contexts, and the model memorizes
the corpus instead. Measured (Adam, step 3e-3, seed 0): the training loss
passes ``H`` near step 60 (0.95) while the loss on fresh text from the same
source rises from the start (3.9 at step 60, above the uniform ``log 16 =
2.77``). So here ``H`` is the floor of the expected loss, not of the training
loss, and ``loss_floor`` (the minimum of the training loss) is ``None``:
it is not known. To make ``H`` the practical floor too, use a corpus much
larger than the model (``num_sequences`` in the thousands, shorter
``sequence_length``). ``metrics`` reports ``heldout_loss``, the same loss on
``HELDOUT_SEQUENCES`` fresh sequences from the source (a fourth seeded
stream), whose expectation is bounded below by exactly ``H``: the gap
``heldout_loss - H`` measures how far the model is from the source.

Target: ``target_loss = corpus_bayes_loss``, i.e. solved when the model
predicts its training text as well as the source that generated it (at the
defaults Adam takes about 40 steps at step 1e-2 and about 130 at 1e-3).
``corpus_infimum <= corpus_bayes_loss`` always (the kernel is one causal
predictor), so the target is reachable in principle. ``metrics`` gives
``bits_per_token`` (the loss / log 2), the top-1 next-token ``accuracy`` and
``heldout_loss`` (above).
"""

from __future__ import annotations

import numpy as np

from . import _validate
from ._problem import Array, Params, Problem, check_params, read_only
from .markov_source import IntArray, MarkovSource, random_sparse_source
from .transformer import TransformerShape, loss_and_grad

#: Weight of the uniform distribution mixed into every row of the kernel
#: (makes the chain irreducible and aperiodic; see markov_source).
SMOOTHING = 0.02
#: The stationary distribution is solved densely over vocab_size ** order states.
MAX_STATES = 1024
#: Sequences of fresh text for ``metrics()["heldout_loss"]`` (floor H).
HELDOUT_SEQUENCES = 256


def _markov_source(
    rng: np.random.Generator, vocab_size: int, order: int, branching: int
) -> MarkovSource:
    return random_sparse_source(rng, vocab_size, order, branching, SMOOTHING)


def prefix_conditional_entropy(tokens: IntArray, first: int) -> float:
    """``-(1/N) sum_(t >= first) sum_(prefix, c) n(prefix, c) log(n(prefix, c) / n(prefix))``.

    ``n(prefix, c)`` counts the sequences of ``tokens`` (B, L) whose first
    ``t`` tokens are ``prefix`` and whose token ``t`` is ``c``; ``N`` is the
    number of predicted tokens ``B (L - first)``. This is the smallest mean
    cross-entropy any function of (position, prefix) can have on the corpus.
    """
    vocab = int(tokens.max()) + 1
    total = 0.0
    for t in range(first, tokens.shape[1]):
        _, prefix_id, prefix_count = np.unique(
            tokens[:, :t], axis=0, return_inverse=True, return_counts=True
        )
        pairs, pair_count = np.unique(
            prefix_id.reshape(-1) * vocab + tokens[:, t], return_counts=True
        )
        total -= float(np.sum(pair_count * np.log(pair_count / prefix_count[pairs // vocab])))
    return total / float(tokens.shape[0] * (tokens.shape[1] - first))


def markov_transformer(
    *,
    seed: int = 0,
    vocab_size: int = 16,
    sequence_length: int = 24,
    num_sequences: int = 64,
    d_model: int = 32,
    heads: int = 2,
    layers: int = 1,
    order: int = 2,
    branching: int = 3,
) -> Problem:
    """Next-token cross-entropy of a small transformer on seeded Markov text."""
    seed = _validate.seed(seed)
    vocab_size = _validate.size("vocab_size", vocab_size)
    sequence_length = _validate.size("sequence_length", sequence_length)
    num_sequences = _validate.size("num_sequences", num_sequences)
    d_model = _validate.size("d_model", d_model)
    heads = _validate.size("heads", heads)
    layers = _validate.size("layers", layers)
    order = _validate.size("order", order)
    branching = _validate.size("branching", branching)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    if vocab_size**order > MAX_STATES:
        raise ValueError(
            f"vocab_size ** order must be <= {MAX_STATES} (the number of Markov states), "
            f"got {vocab_size}**{order} = {vocab_size**order}"
        )
    if branching > vocab_size:
        raise ValueError(
            f"branching must be an int in [1, vocab_size = {vocab_size}], got {branching!r}"
        )
    if sequence_length <= order:
        raise ValueError(
            f"sequence_length must be an int > order = {order} (at least one predicted "
            f"token with its full context), got {sequence_length!r}"
        )
    if d_model % heads != 0:
        raise ValueError(
            f"heads must divide d_model = {d_model}, got heads = {heads!r}; allowed: "
            + ", ".join(str(h) for h in range(1, d_model + 1) if d_model % h == 0)
        )

    # SeedSequence children are keyed by index: the first three streams are
    # those of the original three-stream layout, so the data did not change.
    source_rng, corpus_rng, init_rng, heldout_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)
    )
    source = _markov_source(source_rng, vocab_size, order, branching)
    tokens = source.sample(corpus_rng, num_sequences, sequence_length)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    heldout = source.sample(heldout_rng, HELDOUT_SEQUENCES, sequence_length)
    # Input position t predicts token t + 1; count it when t + 1 >= order.
    position_weights = read_only((np.arange(sequence_length - 1) >= order - 1).astype(np.float64))
    counted = position_weights.astype(bool)
    model = TransformerShape(vocab_size, sequence_length - 1, d_model, heads, layers)
    shapes = model.parameter_shapes()
    name = "markov_transformer"

    def evaluate(params: Params, with_grad: bool) -> tuple[float, dict[str, Array], Array]:
        check_params(name, params, shapes)
        p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
        return loss_and_grad(model, p, inputs, targets, position_weights, with_grad=with_grad)

    def loss(params: Params) -> float:
        return evaluate(params, with_grad=False)[0]

    def grad(params: Params) -> dict[str, Array]:
        return evaluate(params, with_grad=True)[1]

    def metrics(params: Params) -> dict[str, float]:
        value, _, logits = evaluate(params, with_grad=False)
        hits = np.argmax(logits, axis=-1) == targets
        p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
        heldout_loss = loss_and_grad(
            model, p, heldout[:, :-1], heldout[:, 1:], position_weights, with_grad=False
        )[0]
        return {
            "bits_per_token": value / float(np.log(2.0)),
            "accuracy": float(np.mean(hits[:, counted])),
            "heldout_loss": heldout_loss,
        }

    entropy_rate = source.entropy_rate()
    corpus_bayes_loss = float(-np.mean(source.log_likelihoods(tokens)))
    corpus_infimum = prefix_conditional_entropy(tokens, order)
    init = {k: read_only(v) for k, v in model.init_params(init_rng).items()}
    return Problem(
        name=name,
        init_params=init,
        loss=loss,
        grad=grad,
        target_loss=corpus_bayes_loss,
        description=(
            f"{layers}-layer {heads}-head transformer (d_model {d_model}, MLP {4 * d_model}, "
            f"{sum(int(np.prod(s)) for s in shapes.values())} parameters in {len(shapes)} "
            f"tensors) on {num_sequences} x {sequence_length} tokens of a seeded order-{order} "
            f"Markov source over {vocab_size} tokens; mean next-token cross-entropy at "
            f"positions >= {order}; entropy rate {entropy_rate:.4f} nats/token (the floor "
            f"of the held-out loss, not of the training loss); target = the source's own "
            f"loss on this corpus, {corpus_bayes_loss:.4f}; exact infimum over causal "
            f"predictors on this corpus {corpus_infimum:.4f}"
        ),
        loss_floor=None,
        data={
            "entropy_rate": read_only(np.array(entropy_rate)),
            "heldout_tokens": read_only(heldout.astype(np.float64)),
            "tokens": read_only(tokens.astype(np.float64)),
            "transition": source.transition,
            "stationary": source.stationary,
            "corpus_bayes_loss": read_only(np.array(corpus_bayes_loss)),
            "corpus_infimum": read_only(np.array(corpus_infimum)),
        },
        metrics=metrics,
    )
