"""Independent float64 NumPy emulator of Google's non-sharded ``distributed_shampoo``.

Target: google-research/precondition, ``precondition/distributed_shampoo.py``
(``distributed_shampoo(...)`` with ``batch_axis_name=None``,
``shard_optimizer_states=False``, no quantization, no low-rank / frequent
directions / LOBPCG), run with ``jax_enable_x64`` and float64 parameters.

Written from a reading of the library source; it shares no code with it and
none with this project.  Only numpy (and the standard library) is used.

Entry point::

    emulate_google(kwargs, params, grads) -> list of params after each step

The numbered rule sheet written with this file (rules_google.md, handed to the
lead) describes every branch below.  Rule numbers are
quoted in comments as ``[Rn]``.

Two knobs exist because the library itself is ambiguous in this setting:

* ``version``: ``"head"`` (default; current GitHub source) or ``"0.3.0"`` (the
  PyPI release ``precondition-opt==0.3.0``).  They differ only in decoupled
  weight decay: 0.3.0 adds ``lr*wd*x`` to the Nesterov direction and then
  multiplies the whole thing by ``lr`` again (``lr**2 * wd``) when
  ``decoupled_learning_rate=True``; head adds ``wd*x`` then (``lr * wd``).
* ``f32_stat_init``: the library creates the initial statistics
  ``matrix_epsilon * I`` as float32 (and cannot run with float64 gradients
  unless the state is cast to float64 after ``init``).  With ``True`` (default)
  the initial statistics hold ``float64(float32(matrix_epsilon))``, which is
  what the real library computes once the state is cast; ``False`` uses the
  exact float64 ``matrix_epsilon``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "DEFAULTS",
    "GRAFT_TYPES",
    "emulate_google",
    "merge_small_dims",
    "power_iteration",
    "inverse_pth_root_newton",
    "inverse_pth_root_eigh",
    "ParamLayout",
]

# Constants of the library.
TINY = 1e-25  # `_EPSILON`: graft-norm guard and the floor on the power-iteration eigenvalue
POWER_ITERS = 100
POWER_TOL = 1e-6
POWER_SEED = 1729
NEWTON_ITERS = 100
NEWTON_TOL = 1e-6
NEWTON_MAX_ERROR_RATIO = 1.2
NEWTON_RETRY_THRESHOLD = 0.05
NEWTON_TRIES = 6

GRAFT_TYPES = {
    "NONE": 0,
    "SGD": 1,
    "ADAGRAD": 2,
    "RMSPROP": 3,
    "RMSPROP_NORMALIZED": 4,
    "SQRT_N": 5,
    "ADAGRAD_NORMALIZED": 6,
}
_GRAFT_BY_VALUE = {v: k for k, v in GRAFT_TYPES.items()}
PRECONDITIONER_TYPES = {"ALL": 1, "INPUT": 2, "OUTPUT": 3}
_PTYPE_BY_VALUE = {v: k for k, v in PRECONDITIONER_TYPES.items()}

# Constructor defaults (identical in PyPI 0.3.0 and GitHub head, except that
# head adds decay_preconditioning_compute_steps / end_preconditioning_compute_steps).
DEFAULTS: dict[str, Any] = {
    "learning_rate": None,  # required
    "block_size": None,  # required
    "beta1": 0.9,
    "beta2": 0.999,
    "diagonal_epsilon": 1e-10,
    "matrix_epsilon": 1e-6,
    "weight_decay": 0.0,
    "start_preconditioning_step": 5,
    "preconditioning_compute_steps": 1,
    "decay_preconditioning_compute_steps": False,
    "end_preconditioning_compute_steps": None,
    "statistics_compute_steps": 1,
    "best_effort_shape_interpretation": True,
    "graft_type": "SGD",
    "nesterov": True,
    "exponent_override": 0,
    "batch_axis_name": None,
    "statistics_partition_spec": None,
    "preconditioner_partition_spec": None,
    "num_devices_for_pjit": None,
    "shard_optimizer_states": False,
    "best_effort_memory_usage_reduction": False,
    "inverse_failure_threshold": 0.1,
    "moving_average_for_momentum": False,
    "skip_preconditioning_dim_size_gt": 4096,
    "clip_by_scaled_gradient_norm": None,
    "precision": None,  # lax.Precision.HIGHEST; irrelevant in float64 on CPU
    "tensordot_precision": None,
    "relative_matrix_epsilon": True,
    "merge_small_dims_block_size": 4096,
    "lobpcg_topk_precondition": 0,
    "lobpcg_max_iter": 0,
    "precondtioner_type": "ALL",  # sic: the library's keyword is misspelled
    "generate_fd_metrics": False,
    "compression_rank": 0,
    "frequent_directions": False,
    "reset_preconditioner": False,
    "average_grad": False,
    "skip_preconditioning_rank_lt": 1,
    "decoupled_learning_rate": True,
    "decoupled_weight_decay": False,
    "generate_training_metrics": True,
    "reuse_preconditioner": False,
    "eigh": False,
}


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

def _enum_name(value: Any, table: dict[str, int], by_value: dict[int, str], what: str) -> str:
    if isinstance(value, str):
        name = value.split(".")[-1].upper()
        if name not in table:
            raise ValueError(f"unknown {what} {value!r}")
        return name
    if hasattr(value, "name"):  # an enum member
        return _enum_name(value.name, table, by_value, what)
    if int(value) in by_value:
        return by_value[int(value)]
    raise ValueError(f"unknown {what} {value!r}")


def _resolve_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    kw = dict(kwargs)
    # Accept the correctly spelled alias for the misspelled library keyword.
    if "preconditioner_type" in kw:
        if "precondtioner_type" in kw:
            raise TypeError("give only one of preconditioner_type / precondtioner_type")
        kw["precondtioner_type"] = kw.pop("preconditioner_type")
    unknown = set(kw) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"distributed_shampoo() got unexpected keyword(s) {sorted(unknown)}")
    cfg = dict(DEFAULTS)
    cfg.update(kw)
    if cfg["learning_rate"] is None or cfg["block_size"] is None:
        raise TypeError("learning_rate and block_size are required")
    cfg["graft_type"] = _enum_name(cfg["graft_type"], GRAFT_TYPES, _GRAFT_BY_VALUE, "graft_type")
    cfg["precondtioner_type"] = _enum_name(
        cfg["precondtioner_type"], PRECONDITIONER_TYPES, _PTYPE_BY_VALUE, "preconditioner_type")

    # The library's own argument checks (same order, same conditions) [R50].
    if cfg["reset_preconditioner"] and not cfg["frequent_directions"]:
        raise ValueError("reset_preconditioner=True requires frequent_directions")
    if cfg["frequent_directions"] and cfg["compression_rank"] <= 0:
        raise ValueError("frequent_directions=True requires compression_rank > 0")
    if cfg["average_grad"] and not cfg["frequent_directions"]:
        raise ValueError("average_grad requested but frequent_directions is False")
    if cfg["frequent_directions"] and (
            cfg["statistics_compute_steps"] != cfg["preconditioning_compute_steps"]):
        raise ValueError("frequent_directions=True requires statistics_compute_steps"
                         " == preconditioning_compute_steps")

    # Paths this emulator does not model.
    if cfg["best_effort_memory_usage_reduction"]:
        raise NotImplementedError("quantized (int8/int16/bf16) states are not emulated")
    for key in ("batch_axis_name", "statistics_partition_spec",
                "preconditioner_partition_spec", "num_devices_for_pjit"):
        if cfg[key] is not None:
            raise NotImplementedError(f"{key}: sharded / pmap modes are not emulated")
    if cfg["shard_optimizer_states"]:
        raise NotImplementedError("shard_optimizer_states (pjit mode) is not emulated")
    if cfg["compression_rank"] != 0 or cfg["frequent_directions"]:
        raise NotImplementedError("low-rank / frequent-directions preconditioners are not emulated")
    if cfg["lobpcg_topk_precondition"] > 0:
        raise NotImplementedError("LOBPCG deflation is not emulated")
    if cfg["decay_preconditioning_compute_steps"] and cfg["end_preconditioning_compute_steps"] \
            and callable(cfg["learning_rate"]):
        raise NotImplementedError("scheduled preconditioning_compute_steps is not emulated")
    # reuse_preconditioner: the previous root is passed as `prev` and then
    # deleted by both root routines, so it has no numerical effect here.
    return cfg


# --------------------------------------------------------------------------
# Shapes and blocks
# --------------------------------------------------------------------------

def merge_small_dims(shape: Sequence[int], max_dim: int) -> list[int]:
    """[R20] Greedy left-to-right merge of consecutive dims while the product <= max_dim.

    All-ones (non-empty) shape -> [1]; dims of size 1 otherwise disappear;
    a 0-d shape gives [].
    """
    shape = [int(d) for d in shape]
    if shape and all(d == 1 for d in shape):
        return [1]
    out: list[int] = []
    product = 1
    for d in shape:
        if product * d <= max_dim:
            product *= d
        else:
            if product > 1:
                out.append(product)
            product = d
    if product > 1:
        out.append(product)
    return out


class ParamLayout:
    """Everything the library derives from one parameter's shape [R20-R23]."""

    def __init__(self, shape: Sequence[int], cfg: dict[str, Any]):
        self.shape = tuple(int(d) for d in shape)
        self.skip = (len(self.shape) < cfg["skip_preconditioning_rank_lt"]
                     or any(d > cfg["skip_preconditioning_dim_size_gt"] for d in self.shape))
        if cfg["best_effort_shape_interpretation"]:
            self.tshape = tuple(merge_small_dims(self.shape, cfg["merge_small_dims_block_size"]))
        else:
            self.tshape = self.shape
        bs = cfg["block_size"]
        self.splits = []  # (axis, split indices)
        self.split_sizes: list[list[int]] = []
        for axis, d in enumerate(self.tshape):
            if 0 < bs < d:
                nsplit = (d - 1) // bs
                idx = [(k + 1) * bs for k in range(nsplit)]
                sizes = [bs] * nsplit + [d - idx[-1]]
                self.splits.append((axis, idx))
                self.split_sizes.append(sizes)
            else:
                self.split_sizes.append([d])
        rank = len(self.tshape)
        ptype = cfg["precondtioner_type"]
        if ptype == "ALL" or rank <= 1:
            self.precond_dims = [True] * rank
        elif ptype == "INPUT":
            self.precond_dims = [True] * (rank - 1) + [False]
        else:  # OUTPUT
            self.precond_dims = [False] * (rank - 1) + [True]
        self.n_precond = sum(self.precond_dims)
        if ptype == "INPUT" and rank == 1 and not self.skip:
            # The library pads the per-block root list with a trailing None for
            # INPUT even when rank <= 1 made every dim preconditioned, and then
            # fails `assert len(...) == rank` in _preconds_for_grad.  [R22]
            raise ValueError(
                f"Google's library crashes (AssertionError) for preconditioner_type=INPUT "
                f"on a non-skipped parameter of shape {self.shape} whose merged rank is 1")
        self.exponent = (cfg["exponent_override"] if cfg["exponent_override"] != 0
                         else 2 * self.n_precond)
        # statistics sizes: block order (row-major over block indices), then axis order
        self.stat_sizes: list[int] = []
        if not self.skip:
            for t in itertools.product(*self.split_sizes):
                for axis, use in enumerate(self.precond_dims):
                    if use:
                        self.stat_sizes.append(int(t[axis]))

    def partition(self, x: np.ndarray) -> list[np.ndarray]:
        blocks = [np.reshape(x, self.tshape)]
        for axis, idx in self.splits:
            nxt = []
            for b in blocks:
                nxt.extend(np.split(b, idx, axis=axis))
            blocks = nxt
        return blocks

    def merge(self, blocks: list[np.ndarray]) -> np.ndarray:
        for axis, idx in reversed(self.splits):
            n = len(idx) + 1
            blocks = [np.concatenate(blocks[k:k + n], axis=axis)
                      for k in range(0, len(blocks), n)]
        assert len(blocks) == 1
        return np.reshape(blocks[0], self.shape)


def _gram(g: np.ndarray, axis: int) -> np.ndarray:
    others = [i for i in range(g.ndim) if i != axis]
    return np.tensordot(g, g, axes=(others, others))


def _precondition_block(g: np.ndarray, use: Sequence[bool], mats: Sequence[np.ndarray]) -> np.ndarray:
    """[R24] Contract each preconditioned axis with its root, cycling the axes."""
    k = 0
    for u in use:
        if not u:
            g = np.transpose(g, tuple(range(1, g.ndim)) + (0,))
            continue
        g = np.tensordot(g, mats[k], axes=([0], [0]))
        k += 1
    return g


# --------------------------------------------------------------------------
# Roots
# --------------------------------------------------------------------------

def power_iteration(a: np.ndarray, num_iters: int = POWER_ITERS, tol: float = POWER_TOL,
                    padded_size: int | None = None) -> float:
    """[R11] Largest eigenvalue estimate exactly as the library's loop computes it.

    Start vector: the first n entries of RandomState(1729).uniform(-1, 1, N),
    N = the padded size (global max statistic size), so it depends only on n.
    Each pass: v <- v/||v||; w = A v; s = v.w; stop when |s - s_prev| <= tol
    (absolute; s_prev starts at 0) or after num_iters passes.  Returns s.
    """
    n = a.shape[0]
    size = n if padded_size is None else max(int(padded_size), n)
    v = np.random.RandomState(POWER_SEED).uniform(-1.0, 1.0, size)[:n].astype(np.float64)
    s = 0.0
    for _ in range(num_iters):
        v = v / np.linalg.norm(v)
        w = a @ v
        s_new = float(v @ w)
        done = not (abs(s_new - s) > tol)
        s = s_new
        v = w
        if done:
            break
    return s


def _mat_power(m: np.ndarray, p: int) -> np.ndarray:
    """Binary exponentiation in the library's multiplication order."""
    power = np.eye(m.shape[0])
    i = int(p)
    while i > 0:
        if i % 2 == 1:
            power = m @ power
        i //= 2
        m = m @ m
    return power


def inverse_pth_root_newton(a: np.ndarray, p: int, eps: float, relative: bool = True,
                            scalar_path: bool | None = None,
                            padded_size: int | None = None, return_info: bool = False):
    """[R12-R15] Coupled Newton inverse p-th root with the library's ridge, retries and exits.

    Returns (root, error_as_float32), plus a dict (tries, iters, ratio, ridge)
    when ``return_info``.  ``scalar_path`` selects the closed form used when the
    *padded* statistic size is 1 (default: when a is 1x1).
    """
    a = np.asarray(a, dtype=np.float64)
    n = a.shape[0]
    p = int(p)
    max_ev = power_iteration(a, padded_size=padded_size) if relative else 1.0
    ridge = eps * max(max_ev, TINY)
    alpha = -1.0 / p
    if scalar_path is None:
        scalar_path = n == 1
    if scalar_path:
        root = (a + ridge) ** alpha
        info = dict(tries=0, iters=0, ratio=0.0, ridge=ridge)
        return (root, np.float32(0.0), info) if return_info else (root, np.float32(0.0))
    eye = np.eye(n)
    result = eye
    err32 = np.float32(1000.0)
    tries = 0
    failed = True
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        while failed and tries < NEWTON_TRIES:
            damped = a + (ridge * (10 ** tries)) * eye
            z = (1 + p) / (2 * np.linalg.norm(damped))
            m = damped * z
            err = float(np.max(np.abs(m - eye)))
            h = eye * (z ** (1.0 / p))
            old_h = h
            ratio = 1.0
            it = 0
            while it < NEWTON_ITERS and err > NEWTON_TOL and ratio < NEWTON_MAX_ERROR_RATIO:
                mi = (1 - alpha) * eye + alpha * m
                new_m = _mat_power(mi, p) @ m
                new_h = h @ mi
                new_err = float(np.max(np.abs(new_m - eye)))
                old_h, h, m = h, new_h, new_m
                ratio = new_err / err  # err > NEWTON_TOL > 0 inside the loop
                err = new_err
                it += 1
            err32 = np.float32(np.max(np.abs(m - eye)))
            result = h if ratio < NEWTON_MAX_ERROR_RATIO else old_h
            failed = bool(err32 > np.float32(NEWTON_RETRY_THRESHOLD))
            tries += 1
    if return_info:
        return result, err32, dict(tries=tries, iters=it, ratio=ratio, ridge=ridge)
    return result, err32


def inverse_pth_root_eigh(a: np.ndarray, p: int, eps: float, relative: bool = True,
                          padded_size: int | None = None):
    """[R16] eigh variant: ridge = eps*max(lambda_max, 1e-6); eigenvalues clamped at the ridge."""
    a = np.asarray(a, dtype=np.float64)
    n = a.shape[0]
    max_ev = power_iteration(a, padded_size=padded_size) if relative else 1.0
    ridge = eps * max(max_ev, POWER_TOL)
    reg = a + ridge * np.eye(n)
    if not np.all(np.isfinite(reg)):  # XLA's eigh returns NaNs; the NaN error rejects it [R17]
        return np.full((n, n), np.nan), np.float32(np.nan)
    e, u = np.linalg.eigh(reg)
    with np.errstate(divide="ignore"):
        inv_e = np.where(e == 0.0, 0.0, np.power(np.maximum(e, ridge), -1.0 / p))
    root = u * np.sqrt(inv_e)
    val = root @ root.T
    err = np.max(np.abs(u.T @ (reg @ u) - np.diag(e)))
    return val, np.float32(err)


# --------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------

def emulate_google(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                   grads: list[dict[str, np.ndarray]], *, version: str = "head",
                   f32_stat_init: bool = True) -> list[dict[str, np.ndarray]]:
    """Run ``len(grads)`` steps of Google's distributed_shampoo; return params after each step."""
    if version not in ("head", "0.3.0"):
        raise ValueError("version must be 'head' or '0.3.0'")
    cfg = _resolve_config(kwargs)
    lr_spec = cfg["learning_rate"]
    beta1 = float(cfg["beta1"])
    beta2 = float(cfg["beta2"])
    graft = cfg["graft_type"]
    wd = float(cfg["weight_decay"])
    dlr = bool(cfg["decoupled_learning_rate"])
    dwd = bool(cfg["decoupled_weight_decay"])
    scs = int(cfg["statistics_compute_steps"])
    pcs = int(cfg["preconditioning_compute_steps"])
    eps = float(cfg["matrix_epsilon"])
    thr = np.float32(cfg["inverse_failure_threshold"])
    w_stat = 1.0 if beta2 == 1.0 else 1.0 - beta2  # [R6]
    w_mom = (1.0 - beta1) if cfg["moving_average_for_momentum"] else 1.0  # [R41]

    names = sorted(params)  # jax flattens dicts in sorted-key order
    x = {k: np.array(params[k], dtype=np.float64, copy=True) for k in names}
    lay = {k: ParamLayout(x[k].shape, cfg) for k in names}
    init_eps = float(np.float32(eps)) if f32_stat_init else eps  # [R5]
    stats = {k: [init_eps * np.eye(s) for s in lay[k].stat_sizes] for k in names}
    roots = {k: [np.eye(s) for s in lay[k].stat_sizes] for k in names}  # [R9]
    diag = {k: np.zeros_like(x[k]) for k in names}
    mom_graft = {k: np.zeros_like(x[k]) for k in names}
    mom_shampoo = {k: np.zeros_like(x[k]) for k in names}
    sizes = [s for k in names for s in lay[k].stat_sizes]
    max_size = max(sizes) if sizes else 0  # global padding size [R10]

    out: list[dict[str, np.ndarray]] = []
    for step, gdict in enumerate(grads):  # step == state.count before the update [R1]
        g_all = {k: np.asarray(gdict[k], dtype=np.float64).reshape(x[k].shape) for k in names}

        # 1. statistics [R6-R7]
        if scs == 1 or step % scs == 0:
            for k in names:
                L = lay[k]
                if L.skip:
                    continue
                new = []
                idx = 0
                for blk in L.partition(g_all[k]):
                    for axis, use in enumerate(L.precond_dims):
                        if use:
                            new.append(beta2 * stats[k][idx] + w_stat * _gram(blk, axis))
                            idx += 1
                stats[k] = new

        # 2. roots [R8-R17]
        if pcs == 1 or step % pcs == 0:
            for k in names:
                L = lay[k]
                for i, st in enumerate(stats[k]):
                    if cfg["eigh"]:
                        r, err = inverse_pth_root_eigh(st, L.exponent, eps,
                                                       cfg["relative_matrix_epsilon"], max_size)
                    else:
                        r, err = inverse_pth_root_newton(st, L.exponent, eps,
                                                         cfg["relative_matrix_epsilon"],
                                                         scalar_path=(max_size == 1),
                                                         padded_size=max_size)
                    if not (np.isnan(err) or err >= thr):  # [R17]
                        roots[k][i] = r

        # 3. directions, grafting, weight decay, momentum [R25-R45]
        lr = float(lr_spec(step)) if callable(lr_spec) else float(lr_spec)
        new_x = {}
        for k in names:
            L = lay[k]
            g = g_all[k]
            param = x[k]
            if graft in ("ADAGRAD", "ADAGRAD_NORMALIZED"):
                sg = g / (np.linalg.norm(g) + TINY) if graft == "ADAGRAD_NORMALIZED" else g
                diag[k] = diag[k] + np.square(sg)
                graft_dir = sg / (np.sqrt(diag[k]) + cfg["diagonal_epsilon"])
            elif graft in ("RMSPROP", "RMSPROP_NORMALIZED"):
                sg = g / (np.linalg.norm(g) + TINY) if graft == "RMSPROP_NORMALIZED" else g
                diag[k] = beta2 * diag[k] + w_stat * np.square(sg)
                graft_dir = sg / (np.sqrt(diag[k]) + cfg["diagonal_epsilon"])
                clip = cfg["clip_by_scaled_gradient_norm"]
                if clip:
                    scaled_norm = np.linalg.norm(graft_dir) / np.sqrt(float(graft_dir.size))
                    graft_dir = graft_dir / max(1.0, scaled_norm / clip)
            elif graft in ("SGD", "NONE"):
                graft_dir = g
            else:  # SQRT_N
                graft_dir = np.ones_like(g) * np.sign(g)
            graft_dir = graft_dir * (1.0 if dlr else lr)  # [R31]

            if not L.skip:
                blocks = L.partition(g)
                npc = L.n_precond
                pblocks = [_precondition_block(b, L.precond_dims, roots[k][i * npc:(i + 1) * npc])
                           for i, b in enumerate(blocks)]
                pgrad = L.merge(pblocks)
            else:
                pgrad = graft_dir  # [R23]
            if graft != "NONE":
                mult = np.linalg.norm(graft_dir) / (np.linalg.norm(pgrad) + TINY)  # [R30]
            else:
                mult = 1.0
            shampoo_dir = pgrad * mult

            if wd != 0 and not dwd:  # [R35]
                shampoo_dir = shampoo_dir + wd * param
                graft_dir = graft_dir + wd * param
            mom_shampoo[k] = mom_shampoo[k] * beta1 + w_mom * shampoo_dir  # [R40]
            mom_graft[k] = mom_graft[k] * beta1 + w_mom * graft_dir
            run = 1.0 if step >= cfg["start_preconditioning_step"] else 0.0  # [R42]
            m_upd = run * mom_shampoo[k] + (1.0 - run) * mom_graft[k]
            d_upd = run * shampoo_dir + (1.0 - run) * graft_dir
            n_upd = w_mom * d_upd + beta1 * m_upd if cfg["nesterov"] else m_upd  # [R43]
            if wd != 0 and dwd:  # [R36]
                wd_lr = lr if (version == "0.3.0" or not dlr) else 1.0
                n_upd = n_upd + wd_lr * wd * param
            update = -1.0 * (lr if dlr else 1.0) * n_upd  # [R44]
            new_x[k] = param + update
        x = new_x
        out.append({k: x[k].copy() for k in names})
    return out
