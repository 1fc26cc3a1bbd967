"""Metamorphic laws and closed forms every backend must satisfy (float64).

Each law compares the backend with itself (or with a formula), so it checks
a backend even where the reference could share its mistake.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import cast

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shampoo_spec as ss
from shampoo_conformance.adapters import first_order
from shampoo_conformance.protocol import Backend
from shampoo_conformance.suite import strategies as S
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import trajectory_bound
from shampoo_spec.config import GraftingType

HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
          HealthCheck.filter_too_much]  # require_expressible may reject every example
F64 = np.float64


def _orthogonal(n: int, rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def _unrounded(config: ss.ShampooConfig) -> ss.ShampooConfig:
    """``config`` with every stored matrix and the update in the factors' precision.

    Rounding a root, an eigenbasis or an update to a narrower storage dtype
    (eqs. 11a, 17a, 21a) is not rotation or scale covariant; Meta's
    defaults store roots and eigenbases in float32.
    """
    correction = config.eigenvalue_correction
    if correction is not None:
        correction = replace(correction, eigenvectors_dtype=None,
                             corrected_eigenvalues_dtype=None)
    return replace(config, inverse_root_dtype=None, update_dtype=None,
                   eigenvalue_correction=correction)


def _check(ours: list, want: list, w0: dict, bound, what: str) -> None:  # type: ignore[no-untyped-def]
    div = first_divergence(ours, want, w0, bound)
    assert div is None, f"{what}: {div.describe() if div else ''}"


def _unmerged_blocks(config: ss.ShampooConfig, size: int) -> ss.BlockingConfig:
    """Blocks of at most ``size``, dims merged up to ``size`` (the laws' shapes merge none);
    matrices kept as matrices under spectral descent (eq. 16c orthogonalizes matrices:
    the spec refuses a merge target rank below 2 with it)."""
    blocks = ss.BlockingConfig(max_preconditioner_dim=size, merge_dims_up_to=size)
    return blocks if config.spectral is None else replace(blocks, merge_target_rank=2)


def _check_runs(ours: list, theirs: list, w0: dict, bound, what: str) -> None:  # type: ignore[no-untyped-def]
    """Two runs of the backend, each within ``bound`` of its exact trajectory (the law
    maps one exact trajectory onto the other): they differ by at most twice it."""
    twice = replace(bound, rtol=2 * bound.rtol, atol_scale=2 * bound.atol_scale)
    _check(ours, theirs, w0, twice, what)


@pytest.mark.random_configs
@settings(suppress_health_check=HEALTH)
@given(data=st.data(), seed=st.integers(0, 2**16), shape=st.sampled_from([(3, 4), (5, 2)]))
def test_rotation_equivariance(
    backend: Backend, data: st.DataObject, seed: int, shape: tuple[int, ...]
) -> None:
    """G -> U G V^T maps the trajectory W -> U W V^T (full blocks, SGD or no graft, W0 = 0).

    Google's Newton safeguards (stop on error growth, retries) test the
    elementwise max|M - I|, which is not rotation invariant, so they are off;
    so is eq. (11c)'s relative ridge, which scales the max row sum.
    """
    config = data.draw(S.configs_for(backend), label="config")
    root = config.root_inverse
    if isinstance(root, ss.CoupledNewtonConfig):
        root = replace(root, error_growth_limit=None, retries=0, failure_threshold=None)
    if isinstance(root, ss.HigherOrderNewtonConfig):
        # Eq. (11c)'s relative ridge scales ||A||_inf (max row sum), not rotation invariant.
        root = replace(root, rel_epsilon=0.0)
    correction = _unrounded(config).eigenvalue_correction
    if correction is not None:
        # Eqs. (17b, 17c) start from the stored basis (I at first), which does not turn
        # with the gradients: a reused or partly iterated basis is not covariant; nor
        # is D accumulated in I before the first eigenbasis, so that comes at step 1.
        correction = replace(correction, eigenbasis_method="eigh", basis_reuse_tolerance=0.0)
        schedule = replace(config.schedule, start_preconditioning_step=1,
                           precondition_frequency=1, precondition_frequency_growth=None)
    else:
        schedule = config.schedule
    config = replace(
        _unrounded(config),
        root_inverse=root,
        eigenvalue_correction=correction,
        schedule=schedule,
        diagonal=None,  # eq. (16b) is elementwise: not rotation covariant
        grafting=ss.GraftingConfig(type=("sgd" if seed % 2 else "none")),
        # One block per dim, nothing merged (3 * 4 and 5 * 2 exceed 5).
        blocking=_unmerged_blocks(config, 5),
        weight_decay=ss.WeightDecayConfig(),
        exponents=ss.ExponentConfig(),
        # Eq. (20b)'s per-column int8 scales are not rotation or scale covariant,
        # nor are eq. (20c)'s int16 ones.
        momentum=replace(config.momentum, buffers="shared", storage="float",
                         scale_dtype="float32"),
        # Eq. (11b) rounds every factor entry in s, which is not rotation covariant: a
        # root error of kappa u_s everywhere, not the rare one-ulp flips of section 5.
        factor_storage_dtype=None,
        statistics=replace(config.statistics, storage="float", scale_dtype="float32"),
    )
    S.require_expressible(backend, config)
    rng = np.random.default_rng(seed)
    u, v = _orthogonal(shape[0], rng), _orthogonal(shape[1], rng)
    grads = [{"w": rng.standard_normal(shape)} for _ in range(5)]
    rotated = [{"w": u @ g["w"] @ v.T} for g in grads]
    w0 = {"w": np.zeros(shape)}
    base = backend.run(config, w0, grads, dtype=F64)
    turned = backend.run(config, w0, rotated, dtype=F64)
    bound = trajectory_bound(config, w0, grads, F64)
    _check_runs(turned, [{"w": u @ p["w"] @ v.T} for p in base], w0, bound, "rotation equivariance")


@pytest.mark.random_configs
@settings(suppress_health_check=HEALTH)
@given(
    data=st.data(),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-3, 0.5, 7.0, 1e3]),
    # Not (3, 4): its 4 x 4 factor has rank 3 at step 1, whose eps = 0 root is infinite
    # (eq. 13 keeps the previous root; a low-rank one, eq. 10c, starts at 0 and never
    # moves the parameter, where the bound is 0 / 0).
    shape=st.sampled_from([(3, 3), (4, 4), (2, 3, 4)]),
)
def test_gradient_scale_invariance(
    backend: Backend, data: st.DataObject, seed: int, scale: float, shape: tuple[int, ...]
) -> None:
    """eps = 0 (and no absolute ridge of eq. 11c), sum statistics, no grafting: G -> cG
    (c > 0) leaves the trajectory unchanged.

    Each step's factors have full rank from step 1 (every dim <= the product
    of the others), so eps = 0 is well defined.
    """
    config = data.draw(S.configs_for(backend), label="config")
    root_inverse = config.root_inverse
    if isinstance(root_inverse, ss.HigherOrderNewtonConfig):
        # Eq. (11c)'s absolute ridge is the one epsilon that does not scale with G G^T
        # (its relative one does).
        root_inverse = replace(root_inverse, abs_epsilon=0.0)
    config = replace(
        _unrounded(config),
        epsilon=ss.EpsilonConfig(value=0.0),
        root_inverse=root_inverse,
        # Plain sums (statistics.kl off too: eq. 6b's factors scale by c, not c^2,
        # once they are preconditioned by roots of the scaled factors).
        statistics=ss.StatisticsConfig(),
        grafting=ss.GraftingConfig(),
        weight_decay=ss.WeightDecayConfig(),
        exponents=ss.ExponentConfig(),
        # One block per dim, nothing merged (no two adjacent dims multiply to <= 4).
        blocking=_unmerged_blocks(config, 4),
        schedule=ss.ScheduleConfig(),
        # Eq. (20b)'s per-column int8 scales are not rotation or scale covariant.
        momentum=replace(config.momentum, buffers="shared", storage="float",
                         scale_dtype="float32"),
        eigenvalue_correction=None,
        diagonal=None,  # eq. (16b)'s SGD and epsilons are not scale invariant
        # Eq. (11b)'s rounding to s commutes with a power of 2 only (and eps = 0 there
        # leaves a rounded rank-deficient factor an infinite root).
        factor_storage_dtype=None,
    )
    S.require_expressible(backend, config)
    rng = np.random.default_rng(seed)
    grads = [{"w": rng.standard_normal(shape)} for _ in range(4)]
    w0 = {"w": rng.standard_normal(shape)}
    base = backend.run(config, w0, grads, dtype=F64)
    scaled = backend.run(config, w0, [{"w": scale * g["w"]} for g in grads], dtype=F64)
    _check_runs(scaled, base, w0, trajectory_bound(config, w0, grads, F64), "scale invariance")


@pytest.mark.random_configs
@settings(suppress_health_check=HEALTH)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_block_independence(backend: Backend, data: st.DataObject, seed: int) -> None:
    """A blocked (8, 4) parameter equals its two (4, 4) blocks run as separate parameters.

    Normalised grafts divide by the whole parameter's gradient norm, and the
    graft clip (eq. 14d) by its rms, so they are replaced by their plain,
    unclipped forms here; the Adafactor graft (eq. 14e) by its unfactored,
    unscaled form (elementwise); and int8 momentum (eq. 20b, one scale per
    column of the whole parameter) by float storage.
    """
    config = data.draw(S.configs_for(backend), label="config")
    graft = config.grafting
    plain = cast(GraftingType, graft.type.removesuffix("_normalized"))
    graft = replace(graft, type=plain, norm_scope="block", clip_rms=None)
    if graft.factored:
        graft = replace(graft, factor_min_dim=ss.MAX_INTEGER, parameter_scale_floor=None)
    config = replace(
        config,
        blocking=_unmerged_blocks(config, 4),
        grafting=graft,
        exponents=ss.ExponentConfig(),
        momentum=replace(config.momentum, storage="float", scale_dtype="float32"),
        statistics=replace(config.statistics, storage="float", scale_dtype="float32"),
    )
    S.require_expressible(backend, config)
    rng = np.random.default_rng(seed)
    grads = [{"w": rng.standard_normal((8, 4))} for _ in range(5)]
    w0 = {"w": rng.standard_normal((8, 4))}
    whole = backend.run(config, w0, grads, dtype=F64)
    halves = backend.run(
        config,
        {"a": w0["w"][:4], "b": w0["w"][4:]},
        [{"a": g["w"][:4], "b": g["w"][4:]} for g in grads],
        dtype=F64,
    )
    joined = [{"w": np.concatenate([p["a"], p["b"]])} for p in halves]
    _check_runs(whole, joined, w0, trajectory_bound(config, w0, grads, F64), "block independence")


def _no_qr_root(config: ss.ShampooConfig) -> ss.RootInverseConfig:
    """The base's root, or eigh's where it is eq. (10f)'s QR root (which the spec refuses
    beside a diagonal, spectral or low-rank preconditioner; their laws take no root)."""
    r = config.root_inverse
    return ss.EighConfig() if isinstance(r, ss.EighConfig) and r.qr else r


@pytest.mark.parametrize("rank", [None, 1, 3], ids=["full", "low_rank_1", "low_rank_3"])
def test_vector_is_full_matrix_adagrad(backend: Backend, rank: int | None) -> None:
    """1-d Shampoo: W <- W - lr (sum g g^T + eps I)^(-1/2) g, computed directly (eq. 16:
    a library whose defaults are eigenvalue-corrected, SOAP, runs it without).

    With ``rank`` (eq. 10c; the 6 x 6 factor has 6 > rank + 2) the inverse root's
    eigenvalues other than those of the ``rank`` largest eigenvalues are replaced by
    their mean (before step 6 the null eigenvalues tie, but kept or not their inverse
    roots are the mean's).
    """
    n, eps, lr = 6, 1e-3, 0.125
    base = S.base_config_for(backend)
    config = replace(base, learning_rate=lr, root_inverse=_no_qr_root(base),
                     epsilon=ss.EpsilonConfig(value=eps), grafting=ss.GraftingConfig(),
                     eigenvalue_correction=None, spectral=None,
                     low_rank=None if rank is None else ss.LowRankRootConfig(rank=rank))
    rng = np.random.default_rng(0)
    grads = [{"w": rng.standard_normal(n)} for _ in range(8)]
    w0 = {"w": rng.standard_normal(n)}
    w, acc, want = w0["w"].copy(), np.zeros((n, n)), []
    for g in grads:
        acc += np.outer(g["w"], g["w"])
        lam, q = np.linalg.eigh(acc + eps * np.eye(n))  # ascending
        x = lam**-0.5
        if rank is not None:
            x[: n - rank] = x[: n - rank].mean()
        w = w - lr * (q * x) @ q.T @ g["w"]
        want.append({"w": w})
    ours = backend.run(config, w0, grads, dtype=F64)
    _check(ours, want, w0, trajectory_bound(config, w0, grads, F64), "full-matrix AdaGrad")


def _check_first_order(
    backend: Backend, config: ss.ShampooConfig, seed: int, what: str,
    written: Callable[[np.ndarray, list[np.ndarray]], list[np.ndarray]],
) -> None:
    """``config`` on a seeded stream of eight (3, 5) gradients against the trajectory
    ``written(w0, grads)`` computes from the method's textbook formula."""
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal((3, 5)) for _ in range(8)]
    w0 = rng.standard_normal((3, 5))
    want = written(w0, grads)
    stream = [{"w": g} for g in grads]
    ours = backend.run(config, {"w": w0}, stream, dtype=F64)
    bound = trajectory_bound(config, {"w": w0}, stream, F64)
    _check(ours, [{"w": w} for w in want], {"w": w0}, bound, what)


@pytest.mark.parametrize("graft", sorted(first_order.GRAFTS))
@pytest.mark.parametrize("beta1", [0.0, 0.9])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_never_start_is_the_grafting_optimizer(
    backend: Backend, graft: str, beta1: float, momentum: float
) -> None:
    config = replace(
        S.base_config_for(backend),
        learning_rate=0.0625,
        grafting=first_order.GRAFTS[graft],
        gradient_filter=ss.GradientFilterConfig(beta1=beta1, bias_correction=True),
        # No effect without preconditioning; Meta has one flag for both corrections.
        statistics=ss.StatisticsConfig(bias_correction=True),
        momentum=ss.MomentumConfig(momentum=momentum),
        schedule=ss.ScheduleConfig(start_preconditioning_step=None),
    )
    _check_first_order(backend, config, 1, f"never-start = {graft}",
                       lambda w0, grads: first_order.trajectory(
                           graft, w0, grads, 0.0625, beta1, momentum))


@pytest.mark.parametrize("method", sorted(first_order.DIAGONALS))
@pytest.mark.parametrize("beta1", [0.0, 0.9])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_diagonal_preconditioner_is_its_first_order_method(
    backend: Backend, method: str, beta1: float, momentum: float
) -> None:
    """Eq. (16b) without a graft: SGD, sign descent, AdaGrad, RMSprop, Adam from step 1
    (Meta's first-order preconditioner_config classes; torch.optim's methods)."""
    config = replace(
        _unrounded(S.base_config_for(backend)),
        learning_rate=0.0625,
        root_inverse=_no_qr_root(S.base_config_for(backend)),
        diagonal=first_order.DIAGONALS[method],
        eigenvalue_correction=None,  # the diagonal replaces the preconditioner
        spectral=None,
        factor_storage_dtype=None,
        grafting=ss.GraftingConfig(),
        gradient_filter=ss.GradientFilterConfig(beta1=beta1, bias_correction=True),
        statistics=ss.StatisticsConfig(bias_correction=True),  # no effect; Meta's one flag
        momentum=ss.MomentumConfig(momentum=momentum),
        schedule=ss.ScheduleConfig(start_preconditioning_step=1),
    )
    merged = config.blocking.merge_dims_up_to
    config = replace(config, blocking=replace(  # blocks change nothing here
        config.blocking, max_preconditioner_dim=2, merge_dims_up_to=None if merged is None else 2))
    _check_first_order(backend, config, 2, f"diagonal = {method}",
                       lambda w0, grads: first_order.trajectory(
                           method, w0, grads, 0.0625, beta1, momentum))


@pytest.mark.parametrize("beta", [0.5, 0.875])
def test_gpa_with_full_train_interpolation_is_heavy_ball_momentum(
    backend: Backend, beta: float
) -> None:
    """Eq. (20d), GPA with mu_y = 1 and mu_x = beta on an SGD diagonal (eq. 16b) at
    learning rate lr / (1 - beta) is SGD with heavy-ball momentum beta at lr (Meta's
    own equivalence, shampoo_types.py GeneralizedPrimalAveragingConfig)."""
    config = replace(
        _unrounded(S.base_config_for(backend)),
        learning_rate=0.0625 / (1.0 - beta), diagonal=ss.DiagonalPreconditionerConfig(type="sgd"),
        root_inverse=_no_qr_root(S.base_config_for(backend)),
        eigenvalue_correction=None, spectral=None, factor_storage_dtype=None,
        grafting=ss.GraftingConfig(),
        gradient_filter=ss.GradientFilterConfig(), momentum=ss.MomentumConfig(),
        statistics=ss.StatisticsConfig(), weight_decay=ss.WeightDecayConfig(),
        schedule=ss.ScheduleConfig(start_preconditioning_step=1),
        averaging=ss.IterateAveragingConfig(type="gpa", train_interp=1.0, eval_interp=beta),
    )
    _check_first_order(backend, config, 4, f"GPA = heavy ball {beta}",
                       lambda w0, grads: first_order.trajectory(
                           "sgd", w0, grads, 0.0625, 0.0, beta))


def _orthogonalized(g: np.ndarray, spectral: ss.SpectralDescentConfig) -> np.ndarray:
    """Eq. (16c) written out: U_r V_r^T, or Newton-Schulz from the Frobenius-normalised g."""
    if spectral.method == "svd":
        u, s, vt = np.linalg.svd(g, full_matrices=False)
        r = int(np.sum(s > max(g.shape) * np.finfo(F64).eps * s[0]))
        out: np.ndarray = (u[:, :r] @ vt[:r]) * (
            s.sum() if spectral.scale_by_nuclear_norm else 1.0)
        return out
    x = (g / np.linalg.norm(g)).T if g.shape[0] < g.shape[1] else g / np.linalg.norm(g)
    a, b, c = spectral.coefficients
    for _ in range(spectral.num_iterations):  # a X + b X A + c X A^2, A = X^T X, as specified
        gram = x.T @ x
        x = a * x + x @ (b * gram + c * gram @ gram)
    result: np.ndarray = x.T if g.shape[0] < g.shape[1] else x
    return result


@pytest.mark.parametrize("spectral", [
    ss.SpectralDescentConfig(),
    ss.SpectralDescentConfig(num_iterations=8, coefficients=(3.0, -3.2, 1.2)),
    ss.SpectralDescentConfig(method="svd"),
    ss.SpectralDescentConfig(method="svd", scale_by_nuclear_norm=True),
], ids=["newton_schulz", "newton_schulz_modula", "svd", "svd_nuclear_norm"])
@pytest.mark.parametrize("shape", [(3, 5), (6, 2)])
def test_spectral_descent_steps_along_the_orthogonalized_gradient(
    backend: Backend, spectral: ss.SpectralDescentConfig, shape: tuple[int, int]
) -> None:
    """Eq. (16c) without a graft, filter or momentum: W <- W - lr orth(G) every step
    (a rank-deficient gradient on the last step: the SVD's rank rule)."""
    base = _unrounded(S.base_config_for(backend))
    config = replace(
        base, learning_rate=0.0625, spectral=spectral, eigenvalue_correction=None,
        root_inverse=_no_qr_root(base),
        factor_storage_dtype=None, grafting=ss.GraftingConfig(),
        gradient_filter=ss.GradientFilterConfig(), momentum=ss.MomentumConfig(),
        statistics=ss.StatisticsConfig(), weight_decay=ss.WeightDecayConfig(),
        schedule=ss.ScheduleConfig(start_preconditioning_step=1),
        blocking=replace(base.blocking, merge_target_rank=2),  # Meta's rule too
    )
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(shape) for _ in range(4)]
    grads.append(np.outer(rng.standard_normal(shape[0]), rng.standard_normal(shape[1])))
    w0 = rng.standard_normal(shape)
    want, w = [], w0
    for g in grads:
        w = w - 0.0625 * _orthogonalized(g, spectral)
        want.append({"w": w})
    ours = backend.run(config, {"w": w0}, [{"w": g} for g in grads], dtype=F64)
    bound = trajectory_bound(config, {"w": w0}, [{"w": g} for g in grads], F64)
    _check(ours, want, {"w": w0}, bound, f"spectral descent {spectral.method}")


@pytest.mark.random_configs
@settings(suppress_health_check=HEALTH)
@given(data=st.data(), shapes=S.named_shapes(3), seed=st.integers(0, 2**16))
def test_parameter_order_changes_nothing(
    backend: Backend, data: st.DataObject, shapes: dict[str, tuple[int, ...]], seed: int
) -> None:
    config = data.draw(S.configs_for(backend), label="config")
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = S.gradient_stream(shapes, 3, seed, "normal")
    forward = backend.run(config, params, grads, dtype=F64)
    order = list(reversed(params))
    backward = backend.run(
        config, {k: params[k] for k in order}, [{k: g[k] for k in order} for g in grads], dtype=F64
    )
    _check_runs(
        backward, forward, params, trajectory_bound(config, params, grads, F64), "parameter order"
    )
