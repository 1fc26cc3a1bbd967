r"""A small decoder-only transformer in NumPy float64, with a hand-written backward pass.

Notation: ``B`` sequences, ``T`` positions, width ``d``, ``h`` heads of width
``d_h = d / h``, vocabulary ``V``, MLP width ``m = 4 d``. Activations are
(B T, d) arrays (the sequences stacked; attention reshapes to (B, h, T, d_h))
and every weight multiplies from the right (``x @ W``).
The model (pre-norm, as in GPT-2)::

    x_0 = E[tokens] + P                                  E: (V, d),  P: (T, d)
    for each block l:
        x = x + Attention_l(LayerNorm_l1(x))
        x = x + MLP_l(LayerNorm_l2(x))
    logits = LayerNorm_f(x) @ U + c                       U: (d, V),  c: (V,)

    LayerNorm(x) = g * (x - mean(x)) / sqrt(var(x) + eps) + beta   (over the last axis)
    Attention(a) = concat_heads(softmax(Q K^T / sqrt(d_h) + M) V) W_o,
                   Q = a W_q, K = a W_k, V = a W_v,  M_ij = -inf for j > i (causal)
    MLP(a)       = gelu(a W_1 + b_1) W_2 + b_2
    gelu(u)      = u/2 (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))   (the tanh form, exactly)

The loss is the weighted mean next-token cross-entropy
``sum_{b,t} w_t (logsumexp(logits_bt) - logits_bt[y_bt]) / (B sum_t w_t)``.

Each layer is a pair of functions: the forward returns its output and a
cache, the backward maps the output's cotangent and the cache to the
input's cotangent and the parameter gradients. The derivatives are exact
(no approximation beyond float64 rounding); ``datasets/tests`` checks every
parameter tensor against central finite differences.

Large element-wise steps are written in place on named arrays (``y = x @ W;
y += b`` rather than ``x @ W + b``): before reusing an unnamed temporary of
256 kB or more NumPy inspects the C call stack, which on our test machines
costs milliseconds, more than the arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._problem import Array
from ._softmax import softmax_and_log_normalizer

IntArray = NDArray[np.int64]
#: Added to the variance in LayerNorm (as in torch.nn.LayerNorm's default).
LAYER_NORM_EPS = 1e-5
#: MLP hidden width as a multiple of d_model.
MLP_RATIO = 4
_GELU_C = float(np.sqrt(2.0 / np.pi))
_GELU_A = 0.044715


def _affine(x: Array, weight: Array, bias: Array) -> Array:
    """``x @ weight + bias``."""
    y = np.asarray(x @ weight, dtype=np.float64)
    y += bias
    return y


# -- layer norm ---------------------------------------------------------------


class LayerNormCache(NamedTuple):
    normalized: Array  # xhat = (x - mean) / sqrt(var + eps)
    inv_std: Array  # 1 / sqrt(var + eps), shape (N, 1)
    gain: Array


def layer_norm(x: Array, gain: Array, bias: Array) -> tuple[Array, LayerNormCache]:
    """``g * xhat + beta`` with ``xhat = (x - mean) / sqrt(var + eps)`` over the last axis."""
    normalized = np.asarray(x - x.mean(axis=-1, keepdims=True))
    variance = np.mean(np.square(normalized), axis=-1, keepdims=True)
    inv_std = 1.0 / np.sqrt(variance + LAYER_NORM_EPS)
    normalized *= inv_std
    y = np.asarray(normalized * gain)
    y += bias
    return y, LayerNormCache(normalized, inv_std, gain)


def layer_norm_backward(dy: Array, cache: LayerNormCache) -> tuple[Array, Array, Array]:
    """``(dx, dgain, dbias)`` for (N, d) arrays.

    With ``gxhat = dy * g``: ``dx = inv_std * (gxhat - mean(gxhat) - xhat mean(gxhat xhat))``,
    the derivative through both the mean and the variance.
    """
    xhat = cache.normalized
    dxhat = np.asarray(dy * cache.gain)
    projection = np.mean(np.multiply(dxhat, xhat), axis=-1, keepdims=True)
    dx = np.asarray(xhat * projection)
    np.subtract(dxhat, dx, out=dx)
    dx -= dxhat.mean(axis=-1, keepdims=True)
    dx *= cache.inv_std
    return dx, np.sum(np.multiply(dy, xhat), axis=0), np.sum(dy, axis=0)


# -- gelu ---------------------------------------------------------------------


def _gelu_tanh(u: Array) -> Array:
    """``tanh(c (u + a u^3))`` (``u * u * u``: ``u ** 3`` would call a slow ``pow``)."""
    z = np.asarray(u * u)
    z *= u
    z *= _GELU_A
    z += u
    z *= _GELU_C
    np.tanh(z, out=z)
    return z


def gelu(u: Array) -> Array:
    """``u/2 (1 + tanh(c (u + a u^3)))``, ``c = sqrt(2/pi)``, ``a = 0.044715``."""
    y = _gelu_tanh(u)
    y += 1.0
    y *= u
    y *= 0.5
    return y


def gelu_derivative(u: Array, tanh_z: Array | None = None) -> Array:
    """``(1 + tanh z)/2 + (u/2) c (1 + 3 a u^2) (1 - tanh^2 z)`` with ``z = c (u + a u^3)``.

    ``tanh_z`` may pass ``tanh z`` when the forward pass already computed it.
    """
    t = _gelu_tanh(u) if tanh_z is None else tanh_z
    out = np.asarray(u * u)  # (u/2) c (1 + 3 a u^2)
    out *= 3.0 * _GELU_A
    out += 1.0
    out *= u
    out *= 0.5 * _GELU_C
    sech2 = np.asarray(t * t)  # 1 - tanh^2 z
    np.subtract(1.0, sech2, out=sech2)
    out *= sech2
    out += 0.5
    out += 0.5 * t
    return out


# -- causal self-attention ----------------------------------------------------


class AttentionCache(NamedTuple):
    x: Array  # (N, d) input
    q: Array  # (B, h, T, d_h)
    k: Array
    v: Array
    attention: Array  # (B, h, T, T) softmax weights, 0 above the diagonal
    merged: Array  # (N, d) heads concatenated, before W_o
    weights: tuple[Array, Array, Array, Array]  # W_q, W_k, W_v, W_o


def _split_heads(x: Array, batch: int, heads: int) -> Array:
    """(B T, d) -> (B, h, T, d_h)."""
    n, d = x.shape
    return x.reshape(batch, n // batch, heads, d // heads).transpose(0, 2, 1, 3)


def _merge_heads(x: Array) -> Array:
    """(B, h, T, d_h) -> (B T, d)."""
    b, h, t, dh = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(b * t, h * dh)


def causal_self_attention(
    x: Array, query: Array, key: Array, value: Array, output: Array, batch: int, heads: int
) -> tuple[Array, AttentionCache]:
    """Multi-head causal self-attention without biases on ``batch`` sequences, (B T, d)."""
    q = _split_heads(x @ query, batch, heads)
    k = _split_heads(x @ key, batch, heads)
    v = _split_heads(x @ value, batch, heads)
    t = q.shape[2]
    scores = np.asarray(q @ k.transpose(0, 1, 3, 2))
    scores *= 1.0 / np.sqrt(q.shape[-1])
    scores += np.where(np.tril(np.ones((t, t), dtype=bool)), 0.0, -np.inf)  # causal mask
    attention, _ = softmax_and_log_normalizer(scores)
    merged = _merge_heads(attention @ v)
    cache = AttentionCache(x, q, k, v, attention, merged, (query, key, value, output))
    return np.asarray(merged @ output), cache


def causal_self_attention_backward(
    dy: Array, cache: AttentionCache
) -> tuple[Array, Array, Array, Array, Array]:
    """``(dx, dW_q, dW_k, dW_v, dW_o)``.

    Per head, with ``S`` the scaled scores and ``A = softmax(S)``:
    ``dA = dO V^T``, ``dV = A^T dO``, ``dS = A * (dA - rowsum(dA * A))``
    (masked entries have ``A = 0`` so get ``dS = 0``),
    ``dQ = dS K / sqrt(d_h)``, ``dK = dS^T Q / sqrt(d_h)``.
    """
    query, key, value, output = cache.weights
    batch, heads = cache.q.shape[:2]
    d_heads = _split_heads(dy @ output.T, batch, heads)
    d_scores = np.asarray(d_heads @ cache.v.transpose(0, 1, 3, 2))  # dA, then dS in place
    dv = _merge_heads(cache.attention.transpose(0, 1, 3, 2) @ d_heads)
    d_scores -= np.sum(np.multiply(d_scores, cache.attention), axis=-1, keepdims=True)
    d_scores *= cache.attention
    d_scores *= 1.0 / np.sqrt(cache.q.shape[-1])
    dq = _merge_heads(d_scores @ cache.k)
    dk = _merge_heads(d_scores.transpose(0, 1, 3, 2) @ cache.q)
    dx = np.asarray(dq @ query.T)
    dx += dk @ key.T
    dx += dv @ value.T
    return dx, cache.x.T @ dq, cache.x.T @ dk, cache.x.T @ dv, cache.merged.T @ dy


# -- MLP ----------------------------------------------------------------------


class MLPCache(NamedTuple):
    x: Array
    pre_activation: Array
    tanh_z: Array  # the tanh inside gelu, reused by the backward pass
    hidden: Array
    w1: Array
    w2: Array


def mlp(x: Array, w1: Array, b1: Array, w2: Array, b2: Array) -> tuple[Array, MLPCache]:
    """``gelu(x W_1 + b_1) W_2 + b_2``."""
    pre = _affine(x, w1, b1)
    tanh_z = _gelu_tanh(pre)
    hidden = np.add(tanh_z, 1.0)  # gelu(pre) = pre (1 + tanh z) / 2
    hidden *= pre
    hidden *= 0.5
    return _affine(hidden, w2, b2), MLPCache(x, pre, tanh_z, hidden, w1, w2)


def mlp_backward(dy: Array, cache: MLPCache) -> tuple[Array, Array, Array, Array, Array]:
    """``(dx, dW_1, db_1, dW_2, db_2)``."""
    d_pre = gelu_derivative(cache.pre_activation, cache.tanh_z)
    d_pre *= dy @ cache.w2.T
    return (
        np.asarray(d_pre @ cache.w1.T),
        cache.x.T @ d_pre,
        np.sum(d_pre, axis=0),
        cache.hidden.T @ dy,
        np.sum(dy, axis=0),
    )


# -- the model ----------------------------------------------------------------


@dataclass(frozen=True)
class TransformerShape:
    """Sizes of the model; ``context`` is the number of input positions ``T``."""

    vocab_size: int
    context: int
    d_model: int
    heads: int
    layers: int

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names (in forward order) and shapes."""
        d, m, v = self.d_model, MLP_RATIO * self.d_model, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {
            "token_embedding": (v, d),
            "position_embedding": (self.context, d),
        }
        for layer in range(self.layers):
            p = f"block{layer}."
            shapes |= {
                p + "attention_norm.gain": (d,),
                p + "attention_norm.bias": (d,),
                p + "attention.query": (d, d),
                p + "attention.key": (d, d),
                p + "attention.value": (d, d),
                p + "attention.output": (d, d),
                p + "mlp_norm.gain": (d,),
                p + "mlp_norm.bias": (d,),
                p + "mlp.hidden_weight": (d, m),
                p + "mlp.hidden_bias": (m,),
                p + "mlp.output_weight": (m, d),
                p + "mlp.output_bias": (d,),
            }
        shapes |= {
            "final_norm.gain": (d,),
            "final_norm.bias": (d,),
            "unembedding": (d, v),
            "unembedding_bias": (v,),
        }
        return shapes

    def init_params(self, rng: np.random.Generator) -> dict[str, Array]:
        """A GPT-2-like start: embeddings ``N(0, 0.02^2)``; weight matrices
        ``N(0, 1/fan_in)``, those writing into the residual stream (attention
        output, MLP output) further scaled by ``1/sqrt(2 layers)``; gains 1, biases 0."""
        residual_scale = 1.0 / np.sqrt(2.0 * self.layers)
        params: dict[str, Array] = {}
        for name, shape in self.parameter_shapes().items():
            if name.endswith("embedding"):
                value = 0.02 * rng.standard_normal(shape)
            elif name.endswith(".gain"):
                value = np.ones(shape)
            elif len(shape) == 1:
                value = np.zeros(shape)
            else:
                value = rng.standard_normal(shape) / np.sqrt(shape[0])
                if name.endswith(("attention.output", "mlp.output_weight")):
                    value = value * residual_scale
            params[name] = np.asarray(value, dtype=np.float64)
        return params


def loss_and_grad(
    shape: TransformerShape,
    params: Mapping[str, Array],
    inputs: IntArray,
    targets: IntArray,
    position_weights: Array,
    *,
    with_grad: bool = True,
) -> tuple[float, dict[str, Array], Array]:
    """Weighted mean next-token cross-entropy, its gradient and the (B, T, V) logits.

    ``inputs`` and ``targets`` are (B, T) token arrays; ``position_weights``
    (T,) weights position ``t`` of every sequence. With ``with_grad=False``
    the gradient dict is empty.
    """
    p = params
    batch, context = inputs.shape
    tokens = inputs.reshape(-1)
    x = np.asarray(p["token_embedding"][tokens])
    x.reshape(batch, context, -1)[...] += p["position_embedding"]
    caches = []
    for layer in range(shape.layers):
        b = f"block{layer}."
        a, norm1 = layer_norm(x, p[b + "attention_norm.gain"], p[b + "attention_norm.bias"])
        y, attention = causal_self_attention(
            a,
            p[b + "attention.query"],
            p[b + "attention.key"],
            p[b + "attention.value"],
            p[b + "attention.output"],
            batch,
            shape.heads,
        )
        x += y  # no cache holds x itself, so the residual stream is updated in place
        a, norm2 = layer_norm(x, p[b + "mlp_norm.gain"], p[b + "mlp_norm.bias"])
        y, block_mlp = mlp(
            a,
            p[b + "mlp.hidden_weight"],
            p[b + "mlp.hidden_bias"],
            p[b + "mlp.output_weight"],
            p[b + "mlp.output_bias"],
        )
        x += y
        caches.append((norm1, attention, norm2, block_mlp))
    final, final_norm = layer_norm(x, p["final_norm.gain"], p["final_norm.bias"])
    logits = _affine(final, p["unembedding"], p["unembedding_bias"])

    flat_targets = targets.reshape(-1)
    rows = np.arange(flat_targets.size)
    weights = np.tile(position_weights, batch) / (batch * float(np.sum(position_weights)))
    probs, log_normalizer = softmax_and_log_normalizer(logits)
    loss = float(np.dot(log_normalizer - logits[rows, flat_targets], weights))
    logits = logits.reshape(batch, context, -1)
    if not with_grad:
        return loss, {}, logits

    grads: dict[str, Array] = {}
    d_logits = probs  # d loss / d logits = weight * (softmax - onehot)
    d_logits[rows, flat_targets] -= 1.0
    d_logits *= weights[:, None]
    grads["unembedding"] = final.T @ d_logits
    grads["unembedding_bias"] = np.sum(d_logits, axis=0)
    dx, grads["final_norm.gain"], grads["final_norm.bias"] = layer_norm_backward(
        d_logits @ p["unembedding"].T, final_norm
    )
    for layer in reversed(range(shape.layers)):
        b = f"block{layer}."
        norm1, attention, norm2, block_mlp = caches[layer]
        da, *mlp_grads = mlp_backward(dx, block_mlp)
        for suffix, g in zip(
            ("hidden_weight", "hidden_bias", "output_weight", "output_bias"), mlp_grads, strict=True
        ):
            grads[b + "mlp." + suffix] = g
        da, grads[b + "mlp_norm.gain"], grads[b + "mlp_norm.bias"] = layer_norm_backward(da, norm2)
        dx += da
        da, *attention_grads = causal_self_attention_backward(dx, attention)
        for suffix, g in zip(("query", "key", "value", "output"), attention_grads, strict=True):
            grads[b + "attention." + suffix] = g
        da, grads[b + "attention_norm.gain"], grads[b + "attention_norm.bias"] = (
            layer_norm_backward(da, norm1)
        )
        dx += da
    grads["position_embedding"] = dx.reshape(batch, context, -1).sum(axis=0)
    d_embedding = np.zeros_like(p["token_embedding"])
    np.add.at(d_embedding, tokens, dx)
    grads["token_embedding"] = d_embedding
    return loss, grads, logits
