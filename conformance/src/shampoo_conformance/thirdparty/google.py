"""The ``google`` backend: Google's ``distributed_shampoo`` run as its users run it.

Google's library (google-research/precondition, package ``precondition-opt``,
import ``precondition.distributed_shampoo``) is an optax transformation,
driven here from ``to_google(config)``: the kwargs Google takes for the same
Shampoo, with its enums. Each step is ``tx.update`` then
``optax.apply_updates``, jitted, on the CPU.

Google has no dtype argument: it computes in float64 exactly when 64-bit
JAX is on. ``float64`` runs it under ``jax.enable_x64(True)``, where its
``init`` still builds the statistics and roots in float32 (and its update
then fails on float64 gradients, mismatched ``lax.cond`` branches): the
state is cast to float64 after ``init``, as a float64 user has to, the
``training_metrics`` left in float32 as Google's update makes them
(:func:`google_init`). The cast keeps Google's float32 ``matrix_epsilon * I``
(docs/spec.md section 3); the anchors test replaces it by the exact value.
``float32`` runs it as a float32 user does: 64-bit JAX off for the run
(``jax.enable_x64(False)``), Google's state as ``init`` builds it.

Capabilities: a config Google's arguments cannot express (Meta's gradient
filter, per-block graft norms, statistics from zero, ...) raises
:class:`~shampoo_spec.Inexpressible` naming the fields, as do the arguments
one process cannot run (``shard_optimizer_states`` needs a pjit mesh,
``batch_axis_name`` a ``pmap``); :func:`configs` draws Google's own kwargs,
imported with ``from_google``. Where Google as shipped differs from the
spec, :data:`DEVIATIONS` says why (docs/third-party.md).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import currently_in_test_context, reject
from hypothesis import strategies as st
from precondition import distributed_shampoo as ds

from shampoo_conformance.adapters.inputs import check_run_inputs
from shampoo_conformance.adapters.jax import Stepper, adamw, library_stepper, library_steps
from shampoo_conformance.thirdparty.anchor_cases import GOOGLE_CASES
from shampoo_conformance.thirdparty.google_common import draw_kwargs, in_dtype, precision
from shampoo_conformance.thirdparty.optax_library import optax_library_run
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_spec import (
    CoupledNewtonConfig,
    Inexpressible,
    ShampooConfig,
    from_google,
    to_google,
)

#: Parameter dtypes this backend runs: float64 under 64-bit JAX, float32 without it.
dtypes = (np.float64, np.float32)

def _config(**kwargs: Any) -> ShampooConfig:
    """A float64 config from Google's kwargs (JSON form) over a plain base: roots every
    step from the first, absolute epsilon exact in float32, no momentum, SGD graft."""
    base = {"learning_rate": 0.125, "block_size": 8, "beta1": 0.0, "beta2": 1.0,
            "graft_type": "SGD", "start_preconditioning_step": 1,
            "preconditioning_compute_steps": 1, "matrix_epsilon": 2.0**-10,
            "relative_matrix_epsilon": False, "nesterov": False}
    return from_google({**base, **kwargs}, x64=True)


def _own_padding(config: ShampooConfig) -> ShampooConfig:
    """``config`` with eq. (10d)'s ``packing`` and eq. (11d)'s ``deflation_padding``
    "own" (each factor by itself), where Google's padding defects show."""
    fd = config.frequent_directions
    if fd is not None:
        config = dataclasses.replace(config, frequent_directions=dataclasses.replace(
            fd, packing="own"))
    method = config.root_inverse
    if isinstance(method, CoupledNewtonConfig) and method.deflation_rank > 0:
        config = dataclasses.replace(config, root_inverse=dataclasses.replace(
            method, deflation_padding="own"))
    return config


def base_config() -> ShampooConfig:
    """Google's config nearest ``ShampooConfig()``, where the suite's fixed laws start:
    no momentum, absolute epsilon, roots every step (Google's own rules elsewhere:
    statistics from eps I, its graft norms, its Newton safeguards or eigh threshold)."""
    return _config(block_size=1024, eigh=True)


def _case(kwargs: Mapping[str, Any]) -> ShampooConfig:
    """A named case over :func:`_config`'s base, its ``matrix_epsilon`` (if any) replaced
    by the nearest power of 2: Google's float32 initial statistics (DEVIATIONS) would
    otherwise shift every case that sets one by about 1e-12."""
    kwargs = dict(kwargs)
    if "matrix_epsilon" in kwargs:
        kwargs["matrix_epsilon"] = 2.0 ** round(float(np.log2(kwargs["matrix_epsilon"])))
    return _config(**kwargs)


#: Google's own argument sets (those ``nox -s anchors`` checks on the digits MLP) on
#: the suite's named problem, over :func:`_config`'s base.
CASES: dict[str, ShampooConfig] = {name: _case(kw) for name, kw in GOOGLE_CASES.items()}

#: Properties where Google as shipped differs from the spec, with the cause
#: (docs/third-party.md has the measurements and the pointers into its source).
DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        name="float32_initial_statistics",
        config=_config(matrix_epsilon=1e-4, beta2=0.9, eigh=True, learning_rate=0.01,
                       block_size=2, merge_small_dims_block_size=1),
        shapes={"w": (2,)},
        # No pattern: configs() draws matrix_epsilon exact in float32 (see there).
        tests=(),
        cause="under 64-bit JAX Google's init still builds the statistics "
        "matrix_epsilon * I in float32 (distributed_shampoo.py:2595; its update then "
        "fails on float64 gradients unless the state is cast): float32(matrix_epsilon) "
        "starts the factors, a relative change of up to 3e-8 of epsilon (1.7e-12 of the "
        "parameters after 2 steps at matrix_epsilon 1e-4, where float64 rounding allows "
        "9e-15); configs() draws epsilons exact in float32 (powers of 2); "
        "conformance/tests/test_adapter_google.py::"
        "test_float32_initial_statistics_under_x64 demonstrates it",
        kind="defect",
    ),
    Deviation(
        name="one_by_one_statistics_crash",
        config=_config(),
        shapes={"w": (1,)},
        # No pattern: the random properties discard such examples (see run), and no
        # fixed-input property of the suite Google expresses meets the crash.
        tests=(),
        cause="when every statistic of a step is 1 x 1 Google's update crashes: it pads "
        "all statistics to the largest before its roots (distributed_shampoo.py:2842), and "
        "a 1 x 1 matrix takes coupled Newton's matrix_size == 1 branch (850), which skips "
        "the retry loop and leaves total_retries unbound (UnboundLocalError, 907), while the "
        "eigh root comes back 0-d (IndexError, 2950). A model whose only preconditioned "
        "parameter has one element ((1,): merge_small_dims makes it [1], 1307), or a (2, 1) "
        "with the OUTPUT side and no shape interpretation. The suite's random properties "
        "discard such examples (hypothesis.reject, predicted by known_crash); "
        "conformance/tests/test_adapter_google.py::test_all_one_by_one_statistics_crash_google "
        "demonstrates it",
        kind="defect",
    ),
    Deviation(
        name="input_side_vector_crash",
        config=_config(precondtioner_type="INPUT"),
        shapes={"w": (3, 5)},
        # No pattern: the random properties discard such examples (see run).
        tests=(),
        cause="precondtioner_type=INPUT crashes Google's update (AssertionError, "
        "distributed_shampoo.py:1621) on every preconditioned parameter whose shape after "
        "its merge of small dims has rank <= 1 (a vector, or a matrix merged into one): "
        "_preconds_for_grad appends the unpreconditioned last dim's None (1612-1615) "
        "where should_precondition_dims and shapes_for_preconditioners ignore the side "
        "for rank <= 1 (1597, 1631). The suite's random properties discard such examples; "
        "conformance/tests/test_adapter_google.py::test_input_side_on_a_vector_crashes_google "
        "demonstrates it",
        kind="defect",
    ),
    Deviation(
        name="compression_rank_small_statistics_crash",
        config=_config(compression_rank=1),
        shapes={"w": (3,)},
        # No pattern: the random properties discard such examples (see run).
        tests=(),
        cause="with compression_rank c != 0, when every statistic of the step is at most "
        "|c| + 2 (so none is compressed) Google's update crashes (AssertionError, "
        "distributed_shampoo.py:1048): it traces both branches of its lax.cond (2720) on "
        "statistics padded to the largest, and _low_rank_root asserts that size > |c| + 2. "
        "Ours computes every root by root_inverse there (docs/spec.md eq. 10c). The suite's "
        "random properties discard such examples; conformance/tests/test_adapter_google.py::"
        "test_compression_rank_with_only_small_statistics_crashes_google demonstrates it",
        kind="defect",
    ),
    Deviation(
        name="frequent_directions_smaller_factor_sketch_lost",
        # Shown against the reference with packing "own": the imported "google"
        # reproduces it (docs/spec.md eq. 10d).
        config=_own_padding(_config(merge_small_dims_block_size=1, frequent_directions=True,
                                    compression_rank=1, reuse_preconditioner=True)),
        shapes={"w": (8, 8), "v": (5, 5)},
        # No pattern: configs() does not draw frequent_directions (see there).
        tests=(),
        cause="with frequent_directions Google packs each sketch at the size of its "
        "largest statistic, its values lambda and has_zeros in the last rows "
        "(distributed_shampoo.py:590-591), then cuts the packed matrix to the factor's own "
        "rows (2950): a sketched factor smaller than the largest loses lambda (its next "
        "update starts from eps alone) and never leaves its dim unpreconditioned. Ours "
        "keeps the sketch with frequent_directions.packing='own'; 'google' (what "
        "from_google imports) reads the values back as Google does (docs/spec.md eq. "
        "10d; has_zeros is not reproduced); where every sketched factor is as large "
        "as the largest statistic the two agree (the anchors tests: 1e-15 to 1e-12). "
        "conformance/tests/test_adapter_google.py::"
        "test_frequent_directions_sketch_of_a_smaller_factor_is_lost_by_google "
        "demonstrates it",
        kind="defect",
    ),
    Deviation(
        name="frequent_directions_sketch_of_rank_at_most_r",
        config=_config(frequent_directions=True, compression_rank=2,
                       reuse_preconditioner=True),
        # Which inputs show it depends on the noise: on the suite's problem a 16-vector
        # does (0.9 at step 2), an 8-vector does not.
        shapes={"w": (16,)},
        # No pattern: configs() does not draw frequent_directions (see there).
        tests=(),
        cause="while a sketch and its new observation span at most compression_rank "
        "directions (a vector's first steps: rank-1 observations) Google's SVD "
        "(distributed_shampoo.py:1193) returns the null singular values as rounding noise "
        "and tests them exactly (1209, 1251): its tail and root then follow the noise "
        "(a tail near 1e-34, a root near 1e17, or the dim left as it is, input by input). "
        "Ours counts eigenvalues below n eps_f sigma_1 as 0 and leaves the dim "
        "unpreconditioned there (docs/spec.md eq. 10d and section 3)",
        kind="design",
    ),
    Deviation(
        name="lobpcg_smaller_factor_root_rejected",
        # Shown against the reference with deflation_padding "own": the imported
        # "google" reproduces it (docs/spec.md eq. 11d).
        config=_own_padding(_config(block_size=16, merge_small_dims_block_size=1,
                                    lobpcg_topk_precondition=2)),
        shapes={"w": (12, 12), "v": (11, 11)},
        # No pattern: configs() does not draw lobpcg_topk_precondition (see there).
        tests=(),
        cause="with lobpcg_topk_precondition Google judges each root by "
        "max|X^p (A + eps I) - I| over the whole padded matrix (distributed_shampoo.py:"
        "909-922), whose padding rows of X^p A are 0: a factor smaller than the largest "
        "statistic of the step always shows the error 1 >= inverse_failure_threshold, so "
        "its root is rejected on every root step and its preconditioner stays at its "
        "initial identity. Ours judges the factor itself with root_inverse."
        "deflation_padding='own'; 'google' (what from_google imports at a threshold <= 1) "
        "fails those roots as Google does (docs/spec.md eq. 11d); where "
        "every statistic has the largest size the two agree (the anchors tests: 1e-15 to "
        "1e-13). conformance/tests/test_adapter_google.py::"
        "test_lobpcg_rejects_every_root_of_a_smaller_factor demonstrates it",
        kind="defect",
    ),
    Deviation(
        name="average_grad_state_structure",
        config=None,
        tests=(),
        cause="with average_grad Google's init gives every parameter a gradient sum "
        "(distributed_shampoo.py:2617) and its update replaces that of a parameter it does "
        "not precondition by optax.MaskedNode (2637): the state's tree structure changes "
        "after the first step, so a lax.scan over the update (or a restore by the initial "
        "structure) fails; the numbers are unaffected. conformance/tests/"
        "test_adapter_google.py::test_average_grad_changes_googles_state_structure_on_"
        "unpreconditioned_parameters demonstrates it",
        kind="defect",
    ),
    Deviation(
        name="ungrafted_coupled_learning_rate",
        config=None,
        # No pattern: from_google refuses these kwargs, so no property can run them.
        tests=(),
        cause="graft_type=NONE with decoupled_learning_rate=False: after "
        "start_preconditioning_step Google's step applies no learning rate at all "
        "(the lr goes only into the graft, distributed_shampoo.py:3549-3550, which "
        "NONE never applies to the Shampoo direction, 3566-3569, and the final "
        "multiplier is 1, 3610); from_google refuses the combination and configs() does "
        "not draw it; conformance/tests/test_adapter_google.py::"
        "test_ungrafted_coupled_learning_rate_is_ignored_by_google demonstrates it",
        kind="defect",
    ),
    Deviation(
        name="float64_user_run_crash",
        config=None,  # run() casts the state (google_init); library_run, as a user, does not
        tests=("test_side_effect_float64_stays_float64", "test_library_defaults_float64"),
        cause="a float64 user's first update raises TypeError: init builds statistics and "
        "roots in float32 whatever the parameters (distributed_shampoo.py:2594-2600), the "
        "roots computed under 64-bit JAX are float64, and _select_preconditioner's "
        "lax.cond (distributed_shampoo.py:2942-2943) needs equal branch dtypes; the "
        "state must be cast after init (google_init does)",
        kind="defect",
    ),
)


# ------------------------------------------------ JSON form -> Google's real arguments
def google_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``distributed_shampoo``'s keyword arguments from their JSON form (``to_google``'s).

    Enums by name (``graft_type``; the side as Google spells its keyword,
    ``precondtioner_type``, from either spelling) and partition specs from
    lists; everything else (numbers, flags, a callable learning rate) as is.
    """
    out = dict(kwargs)
    if isinstance(out.get("graft_type"), str):
        out["graft_type"] = ds.GraftingType[out["graft_type"]]
    side = out.pop("preconditioner_type", None)
    side = out.pop("precondtioner_type", side)
    if side is not None:
        out["precondtioner_type"] = (ds.PreconditionerType[side] if isinstance(side, str)
                                     else side)  # sic: Google's keyword
    for key in ("statistics_partition_spec", "preconditioner_partition_spec"):
        if isinstance(out.get(key), list | tuple):
            out[key] = jax.sharding.PartitionSpec(*out[key])
    return out


def google_init(
    tx: optax.GradientTransformation, params: Any, matrix_epsilon: float | None = None
) -> Any:
    """Google's initial state with its float32 arrays in float64 (run under 64-bit JAX).

    Google builds statistics and preconditioners in float32 even under x64
    and then fails on float64 gradients (mismatched ``lax.cond`` branches),
    so a float64 user casts them; its ``training_metrics`` stay float32, as
    its update produces them. ``matrix_epsilon``: also replace the cast
    float32 ``matrix_epsilon * I`` statistics by the exact float64 value (a
    documented departure, docs/spec.md section 3; the anchors test compares
    rules, so it does); None keeps what Google built, as a user has it.
    """
    from precondition.quantization_utils import QuantizedValue

    state = tx.init(params)

    def to_float64(a: jax.Array) -> jax.Array:
        return a.astype(jnp.float64) if a.dtype == jnp.float32 else a

    def initial(s: Any, eps: float) -> Any:
        # Quantized statistics (eq. 20c, the pmap path with best_effort_memory_usage_
        # reduction): Google's QuantizedValue of eps I in float64, diagonal eps and no
        # off-diagonal entries (scales 0).
        if isinstance(s, QuantizedValue):
            eye = eps * jnp.eye(s.shape[0], dtype=jnp.float64)
            return QuantizedValue.from_float_value(eye, s.quantized_dtype, extract_diagonal=True)
        return eps * jnp.eye(len(s), dtype=jnp.float64)

    def cast(stats: Any) -> Any:
        floats = jax.tree.map(to_float64, stats._replace(training_metrics=None))
        if matrix_epsilon is not None:
            floats = floats._replace(
                statistics=[initial(s, matrix_epsilon) for s in stats.statistics])
        return floats._replace(training_metrics=stats.training_metrics)

    is_stats: Callable[[Any], bool] = lambda s: isinstance(s, ds.ParameterStats)  # noqa: E731
    return state._replace(stats=jax.tree.map(cast, state.stats, is_leaf=is_stats))


# ------------------------------------------------------------------- capabilities
def _kwargs_or_reason(config: ShampooConfig, dtype: Any) -> tuple[dict[str, Any] | None, str]:
    try:
        kwargs = to_google(in_dtype(config, dtype))
    except Inexpressible as err:
        return None, str(err)
    if kwargs.get("shard_optimizer_states"):
        return None, (f"schedule.roots_take_effect = {config.schedule.roots_take_effect!r} is "
                      "Google's shard_optimizer_states (its pjit path needs a device mesh and "
                      "sharded state; this backend runs its non-sharded path in one process)")
    if kwargs.get("batch_axis_name") is not None:
        return None, ("batch_axis_name needs Google's update inside a pmap over that axis; "
                      "this backend runs one process")
    return kwargs, ""


def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why Google cannot run ``config`` with ``dtype`` parameters here, or None if it can."""
    kwargs, reason = _kwargs_or_reason(config, dtype)
    return reason if kwargs is None else None


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs Google expresses: its own kwargs, drawn and imported with ``from_google``
    (``x64=True``: the suite's random properties run float64)."""
    return draw_kwargs().map(functools.partial(from_google, x64=True))


# ---------------------------------------------------------------------- running
def _transformation(config: ShampooConfig, dtype: Any,
                    learning_rate: Any = None) -> optax.GradientTransformation:
    kwargs, reason = _kwargs_or_reason(config, dtype)
    if kwargs is None:
        raise Inexpressible(f"backend 'google': {reason}")
    if learning_rate is not None:
        kwargs["learning_rate"] = learning_rate
    return ds.distributed_shampoo(**google_kwargs(kwargs))


def _init(tx: optax.GradientTransformation, params: Any, dtype: np.dtype[Any]) -> Any:
    return google_init(tx, params) if dtype == np.float64 else tx.init(params)


def known_crash(kwargs: Mapping[str, Any], params: Mapping[str, Any]) -> str | None:
    """Why Google's update crashes on ``params`` with ``kwargs`` (JSON form), or None.

    Four defects (:data:`DEVIATIONS`), predicted with Google's own shape rules
    (its ``Preconditioner`` and ``merge_small_dims``) over the parameters it
    preconditions (rank >= ``skip_preconditioning_rank_lt``, no dim above
    ``skip_preconditioning_dim_size_gt``): every statistic of the step is
    1 x 1 (Google pads them all to the largest before its roots), or at most
    ``|compression_rank| + 2`` with a compression rank, or at most
    ``5 lobpcg_topk_precondition`` with LOBPCG on the Newton path, or
    ``precondtioner_type=INPUT`` meets a shape of rank <= 1 after the merge.
    """
    rank_lt = kwargs.get("skip_preconditioning_rank_lt", 1)
    size_gt = kwargs.get("skip_preconditioning_dim_size_gt", 4096)
    side = kwargs.get("precondtioner_type", kwargs.get("preconditioner_type", "ALL"))
    merge = kwargs.get("merge_small_dims_block_size", 4096)
    interpret = kwargs.get("best_effort_shape_interpretation", True)
    sizes: list[int] = []
    for name, value in params.items():
        shape = tuple(int(d) for d in np.shape(value))
        if len(shape) < rank_lt or any(d > size_gt for d in shape):
            continue
        merged = ds.merge_small_dims(shape, merge) if interpret else shape
        if side == "INPUT" and len(merged) <= 1:
            return (f"precondtioner_type INPUT on {name!r} of shape {shape}, rank "
                    f"{len(merged)} after Google's merge (AssertionError, line 1621)")
        pre = ds.Preconditioner(np.zeros(shape), kwargs["block_size"], merge, interpret,
                                ds.PreconditionerType[side])
        sizes += [s[0] for s in pre.shapes_for_preconditioners()]
    if sizes and max(sizes) == 1:
        return ("every statistic of the step is 1 x 1 (coupled Newton: UnboundLocalError, "
                "line 907; eigh: IndexError, line 2950)")
    rank = abs(int(kwargs.get("compression_rank", 0) or 0))
    if sizes and rank and max(sizes) <= rank + 2:
        return (f"every statistic of the step is at most compression_rank + 2 = {rank + 2} "
                "(AssertionError, line 1048)")
    top_k = int(kwargs.get("lobpcg_topk_precondition", 0) or 0)
    if sizes and top_k > 0 and not kwargs.get("eigh") and max(sizes) <= 5 * top_k:
        return (f"every statistic of the step is at most 5 lobpcg_topk_precondition = "
                f"{5 * top_k} (JAX's lobpcg_standard: ValueError, expected search dim * 5 < "
                "matrix dim)")
    return None


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``, Google stepping."""
    key = np.dtype(dtype)
    check_run_inputs("google", params, grads, key.name)
    kwargs, _ = _kwargs_or_reason(config, key)
    if kwargs is not None and known_crash(kwargs, params) and currently_in_test_context():
        # Google crashes on this input (DEVIATIONS): a property drawing it skips the
        # example; anywhere else Google runs, and crashes, as its users see it.
        reject()
    with precision(key):
        tx = _transformation(config, key)

        @jax.jit
        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return library_steps(lambda p: _init(tx, p, key), step, params, grads, key)


def _adamw_or_shampoo(optimizer: str, config: ShampooConfig | None, dtype: np.dtype[Any],
                      lr: Any, weight_decay: Any) -> optax.GradientTransformation:
    if optimizer == "shampoo":
        assert config is not None
        return _transformation(config, dtype, learning_rate=lambda count: lr)
    return adamw(lr, weight_decay)  # the jax backend's


def stepper(
    optimizer: str,
    params: dict[str, np.ndarray],
    *,
    lr: float,
    config: ShampooConfig | None = None,
    weight_decay: float = 0.0,
    dtype: Any = np.float64,
) -> Stepper:
    """A closed-loop :class:`~shampoo_conformance.adapters.jax.Stepper`: Google's
    ``distributed_shampoo`` from ``config`` with learning rate ``lr`` (its
    weight decay is the config's), or ``optax.adamw`` (as the jax backend's)."""
    return library_stepper("google", optimizer, params, lr=lr, config=config,
                           weight_decay=weight_decay, dtype=dtype, expressible=expressible,
                           make=_adamw_or_shampoo, init=_init, precision=precision)


# ------------------------------------ the registry's user-run hooks (thirdparty/registry.py)
#: ``distributed_shampoo``'s required arguments (no defaults): a learning rate and
#: the block size (128, its README's), everything else at Google's defaults.
USER_KWARGS: dict[str, Any] = {"learning_rate": 1e-2, "block_size": 128}


def defaults_config() -> ShampooConfig:
    """Google's defaults at :data:`USER_KWARGS`, imported (float64 factors: x64)."""
    return from_google(USER_KWARGS, x64=True)


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any) -> LibraryRun:
    """``distributed_shampoo(**kwargs)`` stepped as a user steps it (its state as its
    ``init`` builds it, no cast: :func:`google_init` is what a float64 user adds)."""
    return optax_library_run(ds.distributed_shampoo(**kwargs), params, grads, dtype)

