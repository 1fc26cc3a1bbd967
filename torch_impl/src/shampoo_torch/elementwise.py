"""The elementwise part of a step: filter, momentum, averaging (eqs. 15, 19-20d).

:func:`update_cohort_state` is phase 2 of the step for a cohort: eq. (3)'s
per-entry flags, the graft state (eqs. 14b, 14e), the filter (eq. 15) and
eq. (6c)'s gradient sum.

These run per parameter in its merged shape (eq. 4), on every rank alike
when distributed; the graft state (eq. 14) is in :mod:`shampoo_torch.grafting`.
``st`` is the parameter's ``optimizer.state[p]``; ``ok`` is its per-entry
mask of eq. (3) ``"skip_block"`` (:mod:`shampoo_torch.refusal`; None: every
block steps), and entries where it is False keep their state and parameter
value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shampoo_spec import GradientFilterConfig, ShampooConfig, is_statistics_step

from . import grafting
from .block_grid import entry_flags
from .cohorts import Cohort
from .device_path import batches, moved, scalar

#: The momentum buffers (eq. 20) and, with int8 storage (eq. 20b), the key of their scales.
MOMENTUM_KEYS = ("momentum", "graft_momentum")
SCALE_SUFFIX = "_scale"


def init_state(
    st: dict[str, Any], cfg: ShampooConfig, shape: tuple[int, ...], dtype: torch.dtype,
    device: torch.device, param_shape: tuple[int, ...] | None = None,
) -> None:
    """A new parameter's ``step`` (0) and the zero elementwise state its config keeps.

    ``graft`` (eq. 14b), ``diagonal`` (V_D, eq. 16b), ``filtered`` (eq. 15), ``momentum`` and with
    separate buffers ``graft_momentum`` (eq. 20), ``gradient_sum`` (S of eq. 6c, with
    ``frequent_directions.average_gradients``), in the merged ``shape``;
    with ``momentum.storage="int8_columnwise"`` and a parameter of rank >= 2
    (``param_shape``), each buffer is int8 in ``param_shape`` and its scales
    ``<key>_scale`` (``param_shape[1:]``, ``momentum.scale_dtype``), eq. (20b).
    Eq. (14e)'s Adafactor moments (:data:`grafting.ADAFACTOR_KEYS`) are shaped
    from ``param_shape``, the parameter's own shape (required with that graft).
    """
    st["step"] = 0
    wanted = {
        "graft": cfg.grafting.has_state,
        "diagonal": cfg.diagonal is not None and cfg.diagonal.has_state,
        "filtered": cfg.gradient_filter.enabled,
        "momentum": cfg.momentum.enabled,
        "graft_momentum": cfg.momentum.separate_buffers,
        "gradient_sum": cfg.frequent_directions is not None
        and cfg.frequent_directions.average_gradients,
    }
    quantized = param_shape is not None and cfg.momentum.quantizes(len(param_shape))
    for key, present in wanted.items():
        if not present:
            continue
        if quantized and key in MOMENTUM_KEYS:
            assert param_shape is not None
            st[key] = torch.zeros(param_shape, dtype=torch.int8, device=device)
            st[key + SCALE_SUFFIX] = torch.zeros(
                param_shape[1:], dtype=_SCALE_DTYPES[cfg.momentum.scale_dtype], device=device)
        else:
            st[key] = torch.zeros(shape, dtype=dtype, device=device)
    if cfg.grafting.factored:  # eq. (14e): moments of the parameter in its own shape
        assert param_shape is not None, "eq. (14e) needs the parameter's own shape"
        grafting.adafactor_init(st, param_shape, cfg.grafting, dtype, device)


_SCALE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def quantize(m: torch.Tensor, dtype: torch.dtype, levels: int = 127, dim: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)`` of eq. (20b) for ``m`` in the parameter's shape (rank >= 2).

    Written as the spec states it, in ``dtype``: subnormals flushed to 0
    (torch keeps them; XLA, and so Google, does not), reciprocals times the
    dividend, round half to even (``torch.round``). ``levels`` 32767 and
    ``dim`` -2: eq. (20c)'s int16 map of a stack of matrices (one scale per
    column of each).
    """
    tiny = torch.finfo(dtype).tiny
    x = m.to(dtype)
    x = torch.where(x.abs() >= tiny, x, torch.zeros((), dtype=dtype, device=x.device))
    recip = torch.ones((), dtype=dtype) / torch.full((), float(levels), dtype=dtype)
    if x.shape[dim] == 0:  # max over an empty dim is 0 (amax refuses it)
        a = torch.zeros_like(x.sum(dim=dim))
    else:
        a = x.abs().amax(dim=dim)
    s = a * recip.to(x.device)
    s = torch.where(s >= tiny, s, torch.zeros((), dtype=dtype, device=x.device))
    positive = (s > 0).unsqueeze(dim)
    inv = 1.0 / torch.where(positive, s.unsqueeze(dim),
                            torch.ones((), dtype=dtype, device=x.device))
    q = torch.where(positive, torch.round(x * inv), torch.zeros((), dtype=dtype, device=x.device))
    return q.to({127: torch.int8, 32767: torch.int16}[levels]), s


def stored_with_diagonal(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Eq. (20c): a stack of factors or inverse roots ``[b, n, n]`` as stored (its
    diagonal in ``dtype``, the rest int16 with one scale per column) and read back,
    in ``a``'s dtype (the backend keeps the read-back values, not the integers)."""
    x = a.to(dtype)
    eye = torch.eye(x.shape[-1], dtype=torch.bool, device=x.device)
    g = torch.diagonal(x, dim1=-2, dim2=-1)
    q, s = quantize(torch.where(eye, torch.zeros((), dtype=dtype, device=x.device), x),
                    dtype, levels=32767, dim=-2)
    back = torch.where(eye, g.unsqueeze(-2), q.to(dtype) * s.unsqueeze(-2))
    return back.to(a.dtype)


def read_momentum(st: dict[str, Any], key: str, shape: tuple[int, ...],
                  dtype: torch.dtype) -> torch.Tensor:
    """A momentum buffer as a float in the merged ``shape``: ``fl_d(q s)`` where int8 (eq. 20b)."""
    buf: torch.Tensor = st[key]
    scale = st.get(key + SCALE_SUFFIX)
    if scale is None:
        return buf
    back: torch.Tensor = (buf.to(scale.dtype) * scale).to(dtype).reshape(shape)
    return back


def write_momentum(st: dict[str, Any], key: str, value: torch.Tensor,
                   param_shape: tuple[int, ...]) -> None:
    """Stores a new buffer (merged shape): as (q, s) of eq. (20b) where int8, else as is."""
    scale = st.get(key + SCALE_SUFFIX)
    if scale is None:
        st[key] = value
        return
    q, s = quantize(value.reshape(param_shape), scale.dtype)
    st[key] = q
    st[key + SCALE_SUFFIX] = s


def masked(new: torch.Tensor, old: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
    """``new`` where ``ok`` (everywhere when None), else ``old`` (eq. 3, ``"skip_block"``)."""
    return new if ok is None else torch.where(ok, new, old)


def statistics_gradient(st: dict[str, Any], g: torch.Tensor, t: int, cfg: ShampooConfig
                        ) -> torch.Tensor | None:
    """Eq. (6c), ``frequent_directions.average_gradients``: G^ = S / s of step t's
    statistics, S the sum of the gradients since the previous statistics step.

    ``g`` is the gradient with eq. (3)'s refused entries 0 (they add 0). S is
    stored, and emptied after a statistics step. None without
    ``average_gradients``: eqs. (6), (6c) then take G itself.
    """
    if "gradient_sum" not in st:
        return None
    total: torch.Tensor = st["gradient_sum"] + g
    statistics_step = is_statistics_step(t, cfg.schedule)
    st["gradient_sum"] = torch.zeros_like(total) if statistics_step else total
    return total / cfg.schedule.statistics_frequency


def filter_gradients(
    sts: Sequence[dict[str, Any]], gs: Sequence[torch.Tensor], t: int, f: GradientFilterConfig,
    oks: Sequence[torch.Tensor | None], beta1: float | None = None,
) -> list[torch.Tensor]:
    """Eq. (15) for several parameters: stores each ``F_t = beta1 F + (1 - beta1) G``;
    returns the Fs the step uses, in order.

    That is ``beta3 F_{t-1} + (1 - beta3) G`` (``F_t`` itself when beta3 is
    beta1), bias corrected when configured; G itself when the filter is off. The
    elementwise ops are ``torch._foreach_*`` ops across the parameters (one launch
    each on an accelerator), the same ops per tensor as one by one.

    ``beta1``: the param group's ``betas[0]`` at this step, in place of ``f.beta1``
    (None: ``f.beta1``); beta3 = None follows it, and so does the bias correction
    ``1 - beta3 beta1^(t-1)`` (the current value, as torch's Adam does).
    """
    if not f.enabled:
        return list(gs)
    b1 = f.beta1 if beta1 is None else beta1
    beta3 = b1 if f.beta3 is None else f.beta3
    olds = [st["filtered"] for st in sts]
    news = torch._foreach_add(torch._foreach_mul(olds, b1),
                              torch._foreach_mul(list(gs), 1.0 - b1))
    # beta3 None is beta1 whatever its value. An explicit beta3 equal to beta1 reuses F_t
    # only for a host float equal to it: a symbolic b1 (compiled) is not compared, which
    # would guard the graph on its value; the direction is then formed apart, same values.
    same = f.beta3 is None or (f.beta3 == f.beta1 and type(b1) is float and b1 == f.beta3)
    used = news if same else torch._foreach_add(
        torch._foreach_mul(olds, beta3), torch._foreach_mul(list(gs), 1.0 - beta3))
    if f.bias_correction:
        used = torch._foreach_div(used, 1.0 - beta3 * b1 ** (t - 1))  # as f's factor
    for st, new, old, ok in zip(sts, news, olds, oks, strict=True):
        st["filtered"] = masked(new, old, ok)
    return list(used)


def momentum(
    st: dict[str, Any],
    shampoo_dir: torch.Tensor | None,
    graft_dir: torch.Tensor | None,
    w: torch.Tensor,
    use_shampoo: bool,
    cfg: ShampooConfig,
    lr: float,
    ok: torch.Tensor | None,
    lr_0: float | None = None,
    mu: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eqs. (19)-(20): the step U from the chosen direction P (Shampoo or graft).

    ``mu``: the param group's ``"momentum"`` at this step, in place of
    ``cfg.momentum.momentum`` (None: the config's); 0 keeps the buffer, M = (1 - d) P.

    P is scaled by lr first with ``lr_before_momentum``, then takes the
    direction decay (eq. 19; with ``scale_by_lr_ratio`` its coefficient is
    ``value * lr / lr_0``, lr_0 the rate the optimizer was built with,
    ``cfg.learning_rate`` when None); with separate buffers both directions
    update their own buffer every step (``shampoo_dir`` is then required).
    Returns U and the new buffers by state key, not yet stored:
    :func:`shampoo_torch.updates.apply_update` commits them with eq. (22)'s guard.
    """
    mom, wd = cfg.momentum, cfg.weight_decay

    def prepare(p: torch.Tensor) -> torch.Tensor:
        if mom.lr_before_momentum:
            p = lr * p
        if wd.applies("direction") and cfg.averaging is None:  # eq. (20d) decays Z
            built = cfg.learning_rate if lr_0 is None else lr_0
            p = p + wd.direction_value(lr, built) * w  # eq. (19)
        return p

    chosen = shampoo_dir if use_shampoo else graft_dir
    assert chosen is not None
    p = prepare(chosen)
    if not mom.enabled:
        return p, {}
    mu, damp = (mom.momentum if mu is None else mu), mom.direction_weight
    like = chosen if graft_dir is None else graft_dir  # None: used up by eq. (18) per block
    shape, dt = tuple(like.shape), like.dtype
    old = read_momentum(st, "momentum", shape, dt)  # eq. (20b): fl_d(q s) where int8
    if not mom.separate_buffers:  # eq. (20), one shared buffer
        m = masked(mu * old + damp * p, old, ok)
        buffers = {"momentum": m}
    else:  # eq. (20), separate Shampoo and graft buffers, both updated every step
        assert shampoo_dir is not None and graft_dir is not None
        ps = p if use_shampoo else prepare(shampoo_dir)
        pg = prepare(graft_dir) if use_shampoo else p
        old_g = read_momentum(st, "graft_momentum", shape, dt)
        buffers = {
            "momentum": masked(mu * old + damp * ps, old, ok),
            "graft_momentum": masked(mu * old_g + damp * pg, old_g, ok),
        }
        m = buffers["momentum"] if use_shampoo else buffers["graft_momentum"]
    out: torch.Tensor = damp * p + mu * m if mom.nesterov else m
    return out, buffers


def averaged_step(
    st: dict[str, Any], u: torch.Tensor, w: torch.Tensor, cfg: ShampooConfig, lr: float,
    lr_power_sum: float, ok: torch.Tensor | None, lr_0: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (20d): the update Delta of W and the new base sequence Z from U (= P).

    Z decays first with direction decay (``Z <- Z (1 - lr alpha)``, eq. 19's
    coefficient alpha); then ``d = -lr U``,
    ``Delta = (1 - mu_x mu_y) d + (1 - mu_x) (Z - W)`` and ``Z + d``, Z kept on
    eq. (3)'s refused entries; the scalars (host floats) by eq. (20e), from
    ``lr_power_sum`` = S_t. :func:`shampoo_torch.updates.apply_update` adds Delta
    and stores Z under eq. (22)'s guard, as a momentum buffer.
    """
    av, wd = cfg.averaging, cfg.weight_decay
    assert av is not None
    old: torch.Tensor = st["averaged"]
    z = old
    if wd.applies("direction"):
        built = cfg.learning_rate if lr_0 is None else lr_0
        z = z * av.decay_factor(lr, wd.direction_value(lr, built))
    step_lr = 1.0 if cfg.momentum.lr_before_momentum else lr
    d = -(step_lr * u)
    along_d, toward_z = av.step_coefficients(lr, lr_power_sum)
    delta = along_d * d + toward_z * (z - w)
    return delta, masked(z + d, old, ok)


def update_cohort_state(c: Cohort, state: Mapping[torch.Tensor, dict[str, Any]]) -> None:
    """Eq. (3) ``"skip_block"`` per-entry flags (no host sync), eqs. (14b), (14e), (15),
    and the gradient sum of eq. (6c) (``average_gradients``)."""
    cfg, params, gp = c.config, c.inp.params, c.inp.gp
    admitted: dict[int, torch.Tensor] = {}  # eq. (14e): whether every block of it steps
    if c.inp.ok is not None:
        for i in c.positions:
            grid, off, g = gp.grids[i], gp.offsets[i], c.g[i]
            c.elem_ok[i] = moved(entry_flags(grid, c.inp.ok, off, c.inp.ok_single.get(i)),
                                 g.device)
            c.g[i] = torch.where(c.elem_ok[i], g, scalar(0.0, g.dtype, g.device))
            if cfg.grafting.factored:
                admitted[i] = moved(c.inp.ok[off:off + grid.num_blocks].all(), g.device)
    for batch in batches(c.positions, params[c.positions[0]].device):
        sts = [state[params[i]] for i in batch]
        gs, oks = [c.g[i] for i in batch], [c.elem_ok.get(i) for i in batch]
        if cfg.grafting.has_state:  # eq. (14b)
            # The refused entries of gs are 0 (above).
            for st, v in zip(sts, grafting.update_states_([st["graft"] for st in sts], gs,
                                                          cfg.grafting, oks, zeroed=True),
                             strict=True):
                st["graft"] = v
        diagonal = [j for j, st in enumerate(sts) if "diagonal" in st]
        if diagonal:  # eq. (16b): V_D as eq. (14b), every step
            assert cfg.diagonal is not None
            news = grafting.update_states_([sts[j]["diagonal"] for j in diagonal],
                                           [gs[j] for j in diagonal], cfg.diagonal.as_graft(),
                                           [oks[j] for j in diagonal], zeroed=True)
            for j, v in zip(diagonal, news, strict=True):
                sts[j]["diagonal"] = v
        c.filtered.update(zip(batch, filter_gradients(sts, gs, c.t, cfg.gradient_filter, oks,
                                                      c.inp.beta1), strict=True))
    for i in c.positions:
        st = state[params[i]]
        if cfg.grafting.factored:  # eq. (14e): the whole parameter, in its own shape
            grafting.adafactor_update(st, c.g[i].reshape(gp.layouts[i].plan.shape), c.t,
                                      cfg.grafting, admitted.get(i))
        averaged = statistics_gradient(st, c.g[i], c.t, cfg)  # eq. (6c)
        if averaged is not None:
            c.averaged_g[i] = averaged
