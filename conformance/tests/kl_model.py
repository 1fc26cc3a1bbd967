"""heavyball 3.2.1's ``KLShampoo`` written down exactly (float64 NumPy), each rule where it
differs from the spec's KL-Shampoo (eq. 6b with eq. 10f's roots) a switch named after the
backend's documented deviation (shampoo_conformance.thirdparty.heavyball_klshampoo).

With every rule on :func:`model` is the library (heavyball/chainable.py:1342-1359,
heavyball/utils.py:1268-1322, :860-944, as the adapter cites them); with every rule in
``spec`` it is the spec on the config the adapter maps the arguments to, so the tests of
test_adapter_heavyball_kl.py show that the reading is complete, that the mapping is right,
and how far each rule alone moves the reference.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

#: The rules where KLShampoo differs from the spec (the deviations' names).
RULES = ("first_step_skipped", "init_factor_identity", "kl_dimension_scale",
         "kl_matrices_only", "eigenvalues_every_step", "epsilon_floor", "qr_ridge",
         "qr_column_order", "factor_balance", "float32_learning_rate", "float32_statistics_weight",
         "precondition_schedule_rounding")


def _mode(x: np.ndarray, m: np.ndarray, k: int) -> np.ndarray:
    """``x x_k m``: dim k of x multiplied by the matrix m (out index first)."""
    return np.moveaxis(np.tensordot(m, x, axes=([1], [k])), 0, k)


def _gram(g: np.ndarray, k: int) -> np.ndarray:
    other = [i for i in range(g.ndim) if i != k]
    return np.tensordot(g, g, axes=(other, other))


def _regularized(d: np.ndarray, eps: float, floor: bool) -> np.ndarray:
    """heavyball's max(d, eps) (``floor``), or eq. (10)'s "shift_after": d - min(d_min, 0)
    + eps."""
    out: np.ndarray = np.maximum(d, eps) if floor else d - min(float(d.min()), 0.0) + eps
    return out


def _f32_weight(b: float, t: int) -> tuple[float, float]:
    """heavyball's lerp weights (keep, take) for step t: (1 - b) / (1 - b^t) with the int64
    step tensor (utils.beta_debias), so in float32."""
    f32 = np.float32
    q = f32(f32(f32(1) / (f32(1) - f32(b) ** f32(t))) * f32(1 - b))
    take = float(f32(f32(1) - f32(f32(1) - q)))
    return float(f32(f32(1) - f32(take))), take


def model(
    w0: np.ndarray,
    grads: Sequence[np.ndarray],
    *,
    lr: float,
    beta1: float,
    shampoo_beta: float,
    eps: float,
    weight_decay: float,
    frequency: int,
    precondition_1d: bool = False,
    init_factor: float = 0.0,
    spec: Collection[str] = (),
) -> list[np.ndarray]:
    """The parameter after each step of ``grads`` (one parameter, float64)."""
    unknown = set(spec) - set(RULES)
    assert not unknown, unknown
    lib = {rule: rule not in spec for rule in RULES}
    b = shampoo_beta
    w = np.array(w0, dtype=np.float64)
    shape = w.shape
    order = len(shape)
    dims = [k for k, n in enumerate(shape) if n > 1 and (order >= 2 or precondition_1d)]
    kl = order == 2 or not lib["kl_matrices_only"]
    # Factors kept divided by their bias correction 1 - b^n (heavyball's lerp does that;
    # the spec divides before its roots: the same A of eq. 7).
    stats = {k: np.zeros((shape[k], shape[k])) for k in dims}
    qs = {k: np.eye(shape[k]) for k in dims}
    held = {k: np.ones(shape[k]) for k in dims}  # eq. (10f)'s lambda' (X = I before roots)
    rooted = False
    e = np.zeros(shape)
    total = 0.0
    updates = 0
    out = []

    def due(t: int) -> bool:
        nonlocal total
        before = total
        total += 1 / frequency
        if t == 1:  # heavyball's init; eq. (8)'s start step (roots_before_start=False)
            return True
        if lib["precondition_schedule_rounding"]:
            return int(total) > int(before)
        return t % frequency == 0

    def lam(k: int) -> np.ndarray:
        """The eigenvalues a step uses: heavyball's diag(Q^T A Q) now, floored at eps; the
        spec's held from the root step."""
        if lib["eigenvalues_every_step"] and (rooted or lib["first_step_skipped"]):
            d = np.sum(qs[k] * (stats[k] @ qs[k]), axis=0)
            return _regularized(d, eps, lib["epsilon_floor"])
        return held[k]

    def inverse(k: int, power: float) -> np.ndarray:
        return (qs[k] * lam(k) ** (-power)) @ qs[k].T

    def statistics(g: np.ndarray, t: int, plain: bool) -> None:
        nonlocal updates
        updates += 1
        if updates == 1:  # the first: weight 1 (heavyball's init passes beta 0)
            keep, take = 0.0, 1.0
        elif lib["float32_statistics_weight"]:
            keep, take = _f32_weight(b, updates)
        else:  # the bias-corrected EMA: A_n = (b (1 - b^(n-1)) A_(n-1) + (1 - b) x) / (1 - b^n)
            take = (1 - b) / (1 - b**updates)
            keep = 1 - take
        # Every factor's update reads the others as they were before it (utils.py:1283-1291).
        invs = {j: inverse(j, 0.5) for j in dims} if kl and not plain else {}
        for k in dims:
            gk = g
            for j, xj in invs.items():
                if j != k:
                    gk = _mode(gk, xj, j)
            outer = _gram(gk, k)
            if kl and not plain and lib["kl_dimension_scale"]:
                outer = outer / np.prod([shape[j] for j in dims if j != k])
            stats[k] = keep * stats[k] + take * outer

    def root(k: int) -> None:
        a, q = stats[k], qs[k]
        product = a @ q
        est = np.sum(q * product, axis=0)
        if lib["qr_ridge"]:
            product = product + max(eps, 64 * a.shape[0] * 2.0**-52) * float(
                np.max(np.abs(est))) * q
        if lib["qr_column_order"]:
            perm = np.argsort(-est, kind="stable")
            qq, r = np.linalg.qr(product[:, perm])
            qq = qq * np.where(np.diag(r) < 0, -1.0, 1.0)
            new = np.empty_like(qq)
            new[:, perm] = qq
        else:
            new = np.linalg.qr(product)[0]
        d = np.sum(new * (a @ new), axis=0)
        srt = np.argsort(d, kind="stable")
        if not lib["qr_column_order"]:
            new, d = new[:, srt], d[srt]
        qs[k] = new
        held[k] = _regularized(d, eps, lib["epsilon_floor"])

    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, dtype=np.float64)
        if lib["first_step_skipped"] and t == 1:
            due(t)
            if lib["init_factor_identity"] and init_factor > 0:
                updates = 1
                for k in dims:
                    stats[k] = init_factor * np.eye(shape[k])
            else:
                statistics(g, t, plain=True)
            for k in dims:  # eigh, flipped to descending (utils._stable_symmetric_basis)
                qs[k] = np.linalg.eigh(stats[k] + 1e-30 * np.eye(shape[k]))[1][:, ::-1]
                d = np.sum(qs[k] * (stats[k] @ qs[k]), axis=0)
                held[k] = _regularized(d, eps, lib["epsilon_floor"])
            rooted = True
            out.append(w.copy())
            continue
        e = beta1 * e + (1 - beta1) * g
        p = e
        for k in dims:
            p = _mode(p, inverse(k, 0.5), k)
        statistics(g, t, plain=False)
        if due(t):
            for k in dims:
                root(k)
            rooted = True
        if lib["factor_balance"] and len(dims) >= 2:
            # psgd_balance_Q (utils.py:2654-2661): every factor to the geometric mean of
            # their max-norms; the KL updates scale with it, plain outer products do not.
            # The held eigenvalues scale with their factor (the library reads them from
            # the factor each step), so on a matrix the rule changes only eps's weight.
            logs = {k: np.log(np.max(np.abs(stats[k]))) for k in dims}
            mean = sum(logs.values()) / len(dims)
            for k in dims:
                stats[k] = stats[k] * np.exp(mean - logs[k])
                held[k] = held[k] * np.exp(mean - logs[k])
        rate = lr
        if lib["float32_learning_rate"]:
            f32 = np.float32
            rate = float(f32(f32(f32(lr) * f32(t)) / f32(t)))
        w = w * (1 - rate * weight_decay) - rate * p
        out.append(w.copy())
    return out
