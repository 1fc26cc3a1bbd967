"""Grafting: the elementwise first-order method whose step size Shampoo borrows, eq. (14).

The graft state V has one entry per parameter entry, so it lives in the
parameter's (merged) layout, not in the blocks; only the norm of the
rescaling (eq. 18, :mod:`shampoo_torch.preconditioner`) depends on the
block or parameter scope. Whether there is a state at all is
``GraftingConfig.has_state``.

Eq. (14e)'s Adafactor (``GraftingConfig.factored``) is not elementwise: its
moments are row and column means of the whole parameter in its own shape
(neither merged nor blocked), held in ``optimizer.state[p]`` under
:data:`ADAFACTOR_KEYS` and updated alike on every rank when distributed
(from the same averaged gradient, O(numel) work), like the elementwise state.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shampoo_spec import GraftingConfig

from .device_path import on_cpu_path

#: The dtypes whose norm the accelerator path takes in float64 (:func:`norm`).
_WIDENED = (torch.float32, torch.bfloat16, torch.float16)


def norm(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``||x||_2`` (over ``dim``, else all of x) that cannot overflow for finite x.

    ``torch.linalg.vector_norm`` sums squares, which overflow once an entry
    passes ~1.8e19 in float32 (eq. 3 admits finite gradients up to about
    2^63.5 / sqrt(|B|), and preconditioning can enlarge them): the eq. (18)
    rescale would then take inf / inf. Where the plain norm is not finite
    but every entry is, this returns ``max|x| * ||x / max|x|||`` instead;
    elsewhere the plain norm itself, bit for bit (a non-finite x keeps its
    inf or NaN norm). On the accelerator path (:mod:`.device_path`) a float32
    or narrower x takes one launch instead: its squares summed in float64,
    which cannot overflow for finite entries, the norm rounded once to x's dtype
    (within an ulp of the plain norm where that is finite).
    """
    if widens_norm(x):
        wide = (torch.linalg.vector_norm(x, dtype=torch.float64) if dim is None
                else torch.linalg.vector_norm(x, dim=dim, dtype=torch.float64))
        narrowed: torch.Tensor = wide.to(x.dtype)
        return narrowed
    plain: torch.Tensor = (
        torch.linalg.vector_norm(x) if dim is None else torch.linalg.vector_norm(x, dim=dim)
    )
    if x.numel() == 0:  # an empty parameter: its norm is 0 (amax has no identity)
        return plain
    if on_cpu_path(plain.device) and bool(torch.isfinite(plain).all()):
        return plain  # what the select below gives; on CPU the read syncs no device
    big = x.abs().amax() if dim is None else x.abs().amax(dim=dim)
    safe = torch.where(big > 0, big, torch.ones_like(big))
    div = safe if dim is None else safe.unsqueeze(dim)
    scaled = big * (torch.linalg.vector_norm(x / div) if dim is None
                    else torch.linalg.vector_norm(x / div, dim=dim))
    return torch.where(torch.isfinite(plain) | ~torch.isfinite(big), plain, scaled)


def widens_norm(x: torch.Tensor) -> bool:
    """Whether :func:`norm` (and eq. 18's block scales) take ``x``'s squares in float64:
    on the accelerator path, for float32 and narrower (MPS has no float64)."""
    return not on_cpu_path(x.device) and x.dtype in _WIDENED and x.device.type != "mps"


def graft_input(x: torch.Tensor, graft: GraftingConfig) -> torch.Tensor:
    """``x / (||x|| + normalize_epsilon)`` for the ``*_normalized`` types, else x (eq. 14a)."""
    if graft.normalizes_input:
        out: torch.Tensor = x / (norm(x) + graft.normalize_epsilon)
        return out
    return x


def update_state(state: torch.Tensor, g: torch.Tensor, graft: GraftingConfig) -> torch.Tensor:
    """Eq. (14b): ``V + g^2`` (beta2 = 1) or ``beta2 V + w g^2``, w = update_weight."""
    g = graft_input(g, graft)
    if graft.beta2 == 1.0:
        return state + g * g
    return graft.beta2 * state + graft.update_weight * g * g


def update_state_(state: torch.Tensor, g: torch.Tensor, graft: GraftingConfig,
                  ok: torch.Tensor | None) -> torch.Tensor:
    """Eq. (14b) written into ``state`` (returned), where ``ok`` (everywhere when None).

    The same operations as :func:`update_state` in the same order (``V + g^2``;
    ``beta2 V``, then ``+ w g^2``), so the same bits; in place, so the state
    keeps its storage: a state replaced every step lands among the step's
    temporaries and pins the allocator's heap (peak RSS, docs/results.md).
    """
    g = graft_input(g, graft)
    if ok is not None or not _keeps_dtype(state, g):
        new = update_state(state, g, graft)
        if new.dtype != state.dtype:  # a wider g: the state widens (as update_state)
            return new if ok is None else torch.where(ok, new, state)
        return torch.where(ok, new, state, out=state) if ok is not None else state.copy_(new)
    if graft.beta2 == 1.0:
        return state.add_(g * g)
    return state.mul_(graft.beta2).add_(graft.update_weight * g * g)


def _keeps_dtype(state: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``state (op) x`` has ``state``'s dtype (``torch.result_type`` is a
    dispatched op: not called where the dtypes are equal)."""
    return state.dtype == x.dtype or torch.result_type(state, x) == state.dtype


def update_states_(states: list[torch.Tensor], gs: list[torch.Tensor], graft: GraftingConfig,
                   oks: list[torch.Tensor | None], zeroed: bool = False) -> list[torch.Tensor]:
    """:func:`update_state_` for several parameters, returned in order: the elementwise
    ops as ``torch._foreach_*`` ops across those whose state keeps its dtype (one
    launch each on an accelerator), the same ops in the same order per tensor as
    :func:`update_state_` (so the same bits); the others (a widening state, eq. 14a's
    normalized input) one by one. ``zeroed``: the gradients are 0 wherever their
    ``oks`` are False (eq. 3's refused entries), so with ``beta2 = 1`` those entries
    of ``V + g^2`` are V itself, bit for bit, and need no select."""
    together = [j for j, (s, g) in enumerate(zip(states, gs, strict=True))
                if _keeps_dtype(s, g) and not graft.normalizes_input]
    out = list(states)
    for j in sorted(set(range(len(states))) - set(together)):
        out[j] = update_state_(states[j], gs[j], graft, oks[j])
    if not together:
        return out
    vs, xs = [states[j] for j in together], [gs[j] for j in together]
    if graft.beta2 == 1.0:  # V + g^2
        terms = torch._foreach_mul(xs, xs)
    else:  # beta2 V, then + w g^2
        terms = torch._foreach_mul(xs, graft.update_weight)
        torch._foreach_mul_(terms, xs)
    if all(oks[j] is None for j in together) or (zeroed and graft.beta2 == 1.0):
        if graft.beta2 != 1.0:
            torch._foreach_mul_(vs, graft.beta2)
        torch._foreach_add_(vs, terms)
        return out
    decayed = vs if graft.beta2 == 1.0 else torch._foreach_mul(vs, graft.beta2)
    for j, v, new in zip(together, vs, torch._foreach_add(decayed, terms), strict=True):
        ok = oks[j]
        out[j] = v.copy_(new) if ok is None else torch.where(ok, new, v, out=v)
    return out


def directions(xs: list[torch.Tensor], states: list[torch.Tensor | None], t: int,
               graft: GraftingConfig) -> list[torch.Tensor]:
    """:func:`direction` for several parameters: eq. (14c)'s ``x / (sqrt(V / bc) +
    epsilon)`` as ``torch._foreach_*`` ops across them (the same ops per tensor, so
    the same bits); the other kinds, and parameters whose quotient widens, one by one."""
    if graft.type in ("none", "sgd", "sign") or graft.normalizes_input or not xs:
        return [direction(x, v, t, graft) for x, v in zip(xs, states, strict=True)]
    vs = [v for v in states if v is not None]
    if len(vs) < len(xs) or any(v.shape != x.shape or not _keeps_dtype(v, x)
                                for x, v in zip(xs, vs, strict=True)):
        return [direction(x, v, t, graft) for x, v in zip(xs, states, strict=True)]
    if graft.corrects_bias:
        vs = list(torch._foreach_div(vs, graft.bias_correction_factor(t)))
    if graft.epsilon_placement == "inside_sqrt":
        denoms = torch._foreach_sqrt(torch._foreach_add(vs, graft.epsilon))
    else:
        denoms = torch._foreach_sqrt(vs)
        torch._foreach_add_(denoms, graft.epsilon)
    return [clip(u, graft) for u in torch._foreach_div(xs, denoms)]


def direction(
    x: torch.Tensor, state: torch.Tensor | None, t: int, graft: GraftingConfig
) -> torch.Tensor:
    """Eq. (14c): X, sign(X), or ``x / (sqrt(V / bc) + epsilon)`` at step t
    (``epsilon_placement="inside_sqrt"``: ``x / sqrt(V / bc + epsilon)``)."""
    kind = graft.type
    if kind in ("none", "sgd"):
        return x
    if kind == "sign":
        return torch.sign(x)
    assert state is not None
    x = graft_input(x, graft)
    if graft.corrects_bias:
        state = state / graft.bias_correction_factor(t)
    if graft.epsilon_placement == "inside_sqrt":
        denom = torch.sqrt(state + graft.epsilon)
    else:
        denom = torch.sqrt(state).add_(graft.epsilon)
    # The quotient over its fresh denominator: the same operations, one parameter-sized
    # temporary where three were.
    if denom.shape == x.shape and _keeps_dtype(denom, x):
        return clip(torch.div(x, denom, out=denom), graft)
    return clip(x / denom, graft)


def clip(u: torch.Tensor, graft: GraftingConfig) -> torch.Tensor:
    """Eq. (14d): ``u / max(1, rms(u) / clip_rms)``, ``rms(u) = ||u|| / sqrt(size)``; u if None.

    ``torch.maximum`` keeps a NaN rms (as the reference's ``np.maximum`` and
    Google's ``jnp.maximum``).
    """
    c = graft.clip_rms
    if c is None:
        return u
    rms = norm(u) / math.sqrt(u.numel())
    out: torch.Tensor = u / torch.maximum(rms / c, torch.ones_like(rms))
    return out


# ------------------------------------------------------------- eq. (14e) Adafactor
#: Eq. (14e)'s moments in ``optimizer.state[p]``, in the parameter's own shape less
#: one dim: R (``shape`` without d0) and C (without d1) when factored, else the
#: full V (``shape``). Not ``"graft"``: that key is eq. (14b)'s elementwise V in the
#: merged shape, which eq. (3) reads per block.
ADAFACTOR_ROW, ADAFACTOR_COL, ADAFACTOR_FULL = "adafactor_row", "adafactor_col", "adafactor_full"
ADAFACTOR_KEYS = (ADAFACTOR_ROW, ADAFACTOR_COL, ADAFACTOR_FULL)


def _without(shape: tuple[int, ...], d: int) -> tuple[int, ...]:
    return tuple(n for k, n in enumerate(shape) if k != d)


def adafactor_init(st: dict[str, Any], shape: tuple[int, ...], graft: GraftingConfig,
                   dtype: torch.dtype, device: torch.device) -> None:
    """Eq. (14e)'s zero moments of a parameter of (its own) ``shape`` into ``st``:
    R and C (``GraftingConfig.factored_dims``), or V."""
    dims = graft.factored_dims(shape)
    if dims is None:
        st[ADAFACTOR_FULL] = torch.zeros(shape, dtype=dtype, device=device)
        return
    d0, d1 = dims
    st[ADAFACTOR_ROW] = torch.zeros(_without(shape, d0), dtype=dtype, device=device)
    st[ADAFACTOR_COL] = torch.zeros(_without(shape, d1), dtype=dtype, device=device)


def _moments(st: dict[str, Any]) -> list[torch.Tensor]:
    return [st[k] for k in ADAFACTOR_KEYS if k in st]


def adafactor_max_abs(st: dict[str, Any]) -> torch.Tensor | None:
    """``max(max|R|, max|C|, max|V|)`` of eq. (14e)'s moments (a 0-d tensor on their
    device), the part of eq. (3)'s m they give every block of the parameter; None
    when the parameter has none (another graft, or no entries)."""
    out = None
    for x in _moments(st):
        if x.numel() == 0:  # amax has no identity
            continue
        m = x.abs().amax()
        out = m if out is None else torch.maximum(out, m)
    return out


def adafactor_update(st: dict[str, Any], g: torch.Tensor, t: int, graft: GraftingConfig,
                     admitted: torch.Tensor | None) -> None:
    """Eq. (14e) at step t: ``R <- beta_t R + (1 - beta_t) mean_d0 Q`` and
    ``C <- beta_t C + (1 - beta_t) mean_d1 Q`` (or ``V <- beta_t V + (1 - beta_t) Q``),
    ``Q = G^2 + eps``, G in the parameter's own shape.

    ``admitted``: a 0-d bool tensor, False when eq. (3) refused any block of the
    parameter: the means span the whole parameter, so such a step leaves R, C
    and V as they are (selected on the device, no sync); None: admitted.
    """
    beta = graft.adafactor_decay(t)
    q = g * g + graft.epsilon
    if ADAFACTOR_FULL in st:
        new = {ADAFACTOR_FULL: beta * st[ADAFACTOR_FULL] + (1.0 - beta) * q}
    else:
        d0, d1 = _dims(tuple(g.shape), graft)
        new = {ADAFACTOR_ROW: beta * st[ADAFACTOR_ROW] + (1.0 - beta) * q.mean(dim=d0),
               ADAFACTOR_COL: beta * st[ADAFACTOR_COL] + (1.0 - beta) * q.mean(dim=d1)}
    for key, value in new.items():
        st[key] = value if admitted is None else torch.where(admitted, value, st[key])


def _dims(shape: tuple[int, ...], graft: GraftingConfig) -> tuple[int, int]:
    """(d0, d1) of a factored parameter of ``shape`` (from the config: the moments'
    shapes cannot tell tied dims apart)."""
    dims = graft.factored_dims(shape)
    assert dims is not None, "a factored moment for an unfactored shape"
    return dims


def adafactor_direction(x: torch.Tensor, st: dict[str, Any], w: torch.Tensor,
                        shape: tuple[int, ...], graft: GraftingConfig) -> torch.Tensor:
    """``graft(X)`` of eq. (14e): ``X (R / mean_d1 R)^(-1/2) C^(-1/2)`` (each broadcast
    back; unfactored ``X V^(-1/2)``) in the parameter's own ``shape``, clipped by eq.
    (14d) over the whole parameter, then times ``max(rms(W), s)`` when
    ``parameter_scale_floor`` s is set (W the parameter before the step).

    ``x`` and ``w`` may be in the merged shape; the result has ``x``'s shape.
    """
    u = x.reshape(shape)
    if ADAFACTOR_FULL in st:
        u = u * torch.rsqrt(st[ADAFACTOR_FULL])
    else:
        d0, d1 = _dims(shape, graft)
        r, c = st[ADAFACTOR_ROW], st[ADAFACTOR_COL]
        r_axis = d1 - 1 if d1 > d0 else d1  # d1's axis in R, which lacks d0
        row = torch.rsqrt(r / r.mean(dim=r_axis, keepdim=True))
        u = u * row.unsqueeze(d0) * torch.rsqrt(c).unsqueeze(d1)
    u = clip(u, graft)
    floor = graft.parameter_scale_floor
    if floor is not None and u.numel() > 0:
        # rms(W) = ||W|| / sqrt(size): norm() cannot overflow where W^2 would.
        rms = norm(w) / math.sqrt(w.numel())
        u = u * torch.clamp(rms, min=floor)
    return u.reshape(x.shape)
