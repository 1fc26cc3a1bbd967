"""Google's root, epsilon, exponent, deflation and sketch arguments as sections (eqs.
9-13, 6c, 10c-10d), for :func:`~.importer.from_google`."""

from __future__ import annotations

from ..._validate import MAX_INTEGER
from ...config import (
    MAX_NEWTON_ITERATIONS,
    CoupledNewtonConfig,
    EighConfig,
    EpsilonConfig,
    ExponentConfig,
    FrequentDirectionsConfig,
    LowRankRootConfig,
    RootInverseConfig,
    StatisticsConfig,
)
from .._parse import Args
from .keys import (
    Preconditioner,
)


def _quantizes_second_moment(a: Args) -> bool:
    """Google's ``quantize_second_moment``: int16 statistics and roots (eq. 20c) with
    ``best_effort_memory_usage_reduction`` and ``batch_axis_name``, and neither
    ``compression_rank`` nor ``frequent_directions``."""
    return a.data.get("best_effort_memory_usage_reduction") is True and (
        a.data.get("batch_axis_name") is not None) and not a.data.get("compression_rank") and (
        a.data.get("frequent_directions") is not True)


def _preconditioner(
    a: Args, beta2: float, x64: bool | None = None, reset_every: int | None = None
) -> Preconditioner:
    """Reads ``matrix_epsilon``, ``eigh``, ``relative_matrix_epsilon``,
    ``inverse_failure_threshold``, ``exponent_override``, ``compression_rank``
    (with ``beta2``), and the frequent-directions keys (:func:`_frequent_directions`).

    Returns ``statistics`` (eq. 6 from ``matrix_epsilon * I``, no bias
    correction, eq. 7), ``epsilon`` (eq. 9, relative with floor 1e-25
    (Newton) or 1e-6 (eigh) and Google's power-iteration lambda_max, eq. 9b,
    ``"ridge_floor"``), ``root_inverse`` (eigh,
    eq. 10, or Google's coupled Newton, eq. 11, each failing at
    ``inverse_failure_threshold``: eq. 13's eigh error
    ``max|Q^T (A + eps I) Q - diag(lambda)|``, eq. 11's Newton error) and
    ``exponents`` (eq. 12: 2 * preconditioned dims, or ``exponent_override``
    when > 0). ``compression_rank`` c != 0: ``low_rank`` (eq. 10c) of rank |c|,
    keeping the largest eigenvalues when c > 0 and the smallest when c < 0,
    judged at ``inverse_failure_threshold``, lambda_max floored at 1e-6 (Google's
    ``_low_rank_root``); it turns the int16 storage below off, as in Google.
    With ``frequent_directions`` the rank sketches the factors instead (eqs.
    6c, 10d) and ``low_rank`` is None.
    ``best_effort_memory_usage_reduction`` with ``batch_axis_name``
    stores the statistics and roots as int16 with their diagonals
    (``storage="int16_columnwise_diagonal"``, eq. 20c) in Google's statistics
    dtype: float32, float64 under ``x64`` (and when not said).
    """
    eps = a.number("matrix_epsilon", 1e-6)
    use_eigh = a.flag("eigh", False)
    relative = a.flag("relative_matrix_epsilon", True)
    # Google judges every root by it, eigh roots included (_skip: error >= threshold,
    # the error a float32 metric): eq. (13) for eigh, eq. (11) for Newton.
    threshold = a.number("inverse_failure_threshold", 0.1)
    quantized = _quantizes_second_moment(a)
    if use_eigh:
        root_inverse: RootInverseConfig = EighConfig(failure_threshold=threshold)
        _deflation(a, use_eigh, quantized)  # read and checked: the eigh path has none
    else:
        rank, iterations = _deflation(a, use_eigh, quantized)
        root_inverse = CoupledNewtonConfig(
            max_iterations=100,
            tolerance=1e-6,
            error_growth_limit=1.2,
            retries=5,
            retry_epsilon_factor=10.0,
            retry_error_threshold=0.05,
            failure_threshold=threshold,
            deflation_rank=rank,
            deflation_iterations=iterations,
            # Eq. (11d): Google deflates its padded statistics and judges the padding,
            # which fails every smaller factor's root at a threshold <= 1.
            deflation_padding="google" if rank > 0 and threshold <= 1 else "own",
        )
    override = a.number("exponent_override", 0)
    # Eq. (10c): compression_rank, its eigh root floored at 1e-6 like the eigh path's.
    compression = a.integer("compression_rank", 0, low=-MAX_INTEGER)
    sketch = _frequent_directions(a, compression, reset_every)
    low_rank = None if compression == 0 or sketch is not None else LowRankRootConfig(
        rank=abs(compression), keep="largest" if compression > 0 else "smallest",
        failure_threshold=threshold, relative_floor=None if use_eigh else 1e-6,
    )
    return Preconditioner(
        statistics=StatisticsConfig(
            beta2=beta2, bias_correction=False, initial_value="epsilon_identity",
            storage="int16_columnwise_diagonal" if quantized else "float",
            scale_dtype="float64" if quantized and x64 is not False else "float32",
        ),
        epsilon=EpsilonConfig(
            value=eps,
            scale="relative" if relative else "absolute",
            # Newton's ridge floor is 1e-25; the eigh path floors lambda_max at 1e-6.
            relative_floor=1e-6 if use_eigh else 1e-25,
            placement="ridge_floor",
            # Google's lambda_max: 100 power-iteration steps, tolerance 1e-6 (eq. 9b).
            lambda_max="power_iteration" if relative else "exact",
        ),
        root_inverse=root_inverse,
        low_rank=low_rank,
        frequent_directions=sketch,
        exponents=ExponentConfig(default="preconditioned_dims", override=max(override, 0.0)),
    )


def _deflation(a: Args, use_eigh: bool, quantized: bool) -> tuple[int, int | None]:
    """Reads ``lobpcg_topk_precondition`` k and ``lobpcg_max_iter`` m: eq. (11d)'s
    ``(deflation_rank, deflation_iterations)``.

    Google deflates only in its coupled Newton root: with ``eigh`` (or k <= 0)
    both keys have no effect and (0, None) is returned. m = 0 means k
    iterations (None); m < 0 runs none (0), as Google's loop does. With the
    int16 statistics (eq. 20c) the read-back factors are not symmetric, which
    LOBPCG assumes: refused.
    """
    k = a.integer("lobpcg_topk_precondition", 0, low=-MAX_INTEGER)
    m = a.integer("lobpcg_max_iter", 0, low=-MAX_INTEGER, high=MAX_NEWTON_ITERATIONS)
    if use_eigh or k <= 0:
        return 0, None
    if quantized:
        raise NotImplementedError(
            f"from_google.lobpcg_topk_precondition = {k} with best_effort_memory_usage_reduction "
            f"= True and batch_axis_name = {a.data['batch_axis_name']!r} is not supported "
            "(eq. 11d's LOBPCG needs symmetric factors; eq. 20c's read-back factors are not): "
            "lobpcg_topk_precondition = 0."
        )
    return k, (None if m == 0 else max(m, 0))


def _reset_period(a: Args, beta2: float) -> tuple[int | None, float]:
    """Reads ``reset_preconditioner`` (with ``beta2``): ``(reset_every, beta2)``.

    Google's rule: the sketch is emptied every ``round(1 / (1 - beta2))`` steps
    (never when beta2 = 1), and beta2 becomes 1 for everything (statistics,
    sketch decay, RMSPROP graft). Without it: ``(None, beta2)``.
    """
    if not a.flag("reset_preconditioner", False):
        return None, beta2
    if a.data.get("frequent_directions") is not True:
        raise ValueError("reset_preconditioner = true requires frequent_directions = true "
                         "(Google raises the same).")
    if beta2 == 1.0:
        return None, 1.0
    period = round(1.0 / (1.0 - beta2))  # np.round: ties to even, as Python's round
    if period > MAX_INTEGER:
        raise ValueError(f"beta2 = {beta2!r} with reset_preconditioner = true is invalid: "
                         f"its reset period round(1 / (1 - beta2)) = {period} exceeds "
                         f"{MAX_INTEGER}.")
    return period, 1.0


def _frequent_directions(
    a: Args, compression: int, reset_every: int | None
) -> FrequentDirectionsConfig | None:
    """Reads ``frequent_directions``, ``average_grad``, ``reuse_preconditioner``,
    ``statistics_compute_steps``, ``preconditioning_compute_steps`` (with
    ``compression_rank`` and the reset period of :func:`_reset_period`).

    ``frequent_directions`` (eqs. 6c, 10d): sketches of rank
    ``compression_rank`` (> 0, as Google requires), ``average_grad`` as
    ``average_gradients``, Google's floor 1e-6 under the sketch's largest
    value for a relative epsilon. Google's own refusals are kept (each a
    ValueError there): FD without ``compression_rank > 0``, ``average_grad``
    without FD, statistics and root periods that differ. FD without
    ``reuse_preconditioner`` crashes Google (its sketch update asserts a
    previous preconditioner): refused too.
    """
    fd = a.flag("frequent_directions", False)
    average = a.flag("average_grad", False)
    if average and not fd:
        raise ValueError("average_grad = true requires frequent_directions = true "
                         "(Google raises the same).")
    if not fd:
        return None
    if compression <= 0:
        raise ValueError(f"frequent_directions = true requires compression_rank > 0, found "
                         f"{compression} (Google raises the same).")
    stats = a.integer("statistics_compute_steps", 1, low=1)
    roots = a.integer("preconditioning_compute_steps", 1, low=1)
    if stats != roots:
        raise ValueError(f"frequent_directions = true requires statistics_compute_steps "
                         f"({stats}) = preconditioning_compute_steps ({roots}) (Google "
                         "raises the same).")
    if not a.flag("reuse_preconditioner", False):
        raise ValueError("frequent_directions = true requires reuse_preconditioner = true: "
                         "Google's sketch update reads the previous preconditioner, and "
                         "without it Google's _fd_update_root fails an assertion.")
    # packing "google": Google packs each sketch at its largest statistic's size and cuts
    # it to the factor's rows, losing a smaller factor's values (eq. 10d, kept_values).
    return FrequentDirectionsConfig(rank=compression, average_gradients=average,
                                    reset_every=reset_every, relative_floor=1e-6,
                                    packing="google")
