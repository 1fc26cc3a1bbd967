"""The ``optax-shampoo`` backend: PyPI's optax-shampoo 0.0.6, Google's 2022 Shampoo.

``optax_shampoo.distributed_shampoo`` is a copy of Google's
``distributed_shampoo`` from 2022 (google-research/scalable_shampoo), the
ancestor of precondition's that the ``google`` backend runs. Diffed against
precondition's it lacks 9 arguments (``eigh``, ``compression_rank``,
``frequent_directions``, ``average_grad``, ``reset_preconditioner``,
``reuse_preconditioner``, ``generate_fd_metrics``,
``decay_preconditioning_compute_steps``, ``end_preconditioning_compute_steps``),
``GraftingType.NONE`` and ``PreconditionerType.OUTPUT``: a config that needs
one raises :class:`~shampoo_spec.Inexpressible` naming it. Where both have an
argument, four rules differ (:func:`from_optax_shampoo` imports them):

- eq. (11): coupled Newton without retries (``retries=0``; precondition
  retries 5 times at 10x ridge, ``optax_shampoo/distributed_shampoo.py:515-530``);
- eq. (9): relative epsilon ``eps * max(lambda_max, 1e-6)`` (:492; 1e-25 there);
- eqs. (14), (18): graft norms with 1e-16 (:2189, :2201, :2243; 1e-25 there);
- eq. (21): ``decoupled_weight_decay`` with ``decoupled_learning_rate`` decays by
  ``lr * (lr * weight_decay) * x`` (:2278-2283): imported as weight decay
  ``lr * weight_decay`` (a constant learning rate only), a defect (DEVIATIONS).

Otherwise the two sources agree line for line on the non-sharded path
(statistics, power iteration, LOBPCG deflation, blocking, merging, grafts,
momentum, schedule), so ``from_google``'s rules hold (docs/spec.md 4.2).

JAX 0.10.2 cannot run it as shipped (:data:`SHIMS`): ``init`` raises
``AttributeError: module 'jax' has no attribute 'tree_map'`` (:1545), and
with that aliased every coupled-Newton root raises ``TypeError: while_loop
body function carry input and carry output must have equal types`` (:524-527,
its initial ``error_ratio`` is ``True``, a bool, the loop's a float).
:func:`compat` applies two shims to the library's module for the duration of
a run (never to ``jax`` itself): ``jax.tree_map``/``tree_flatten``/
``tree_unflatten`` as ``jax.tree.*``, and ``lax.while_loop`` casting a bool
initial carry to the body's dtype (exactly precondition's later fix,
``True`` -> ``1.0``). Every run here, ``library_run`` included, is shimmed.

Runs follow the ``google`` backend (:mod:`.google_common`'s ``in_dtype``,
``precision`` and drawn kwargs, shared without importing precondition): float64 under 64-bit
JAX with the state cast after ``init`` (:func:`_init`: its update crashes on
float32 state, DEVIATIONS), float32 without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import currently_in_test_context, reject
from hypothesis import strategies as st
from optax_shampoo import distributed_shampoo as ds

from shampoo_conformance.adapters.inputs import check_run_inputs
from shampoo_conformance.adapters.jax import Stepper, adamw, library_stepper, library_steps
from shampoo_conformance.thirdparty.anchor_cases import GOOGLE_CASES
from shampoo_conformance.thirdparty.google_common import draw_kwargs, in_dtype, precision
from shampoo_conformance.thirdparty.optax_library import optax_library_run
from shampoo_conformance.thirdparty.optax_shampoo_deviations import _JAX as _JAX
from shampoo_conformance.thirdparty.optax_shampoo_deviations import SHIMS as SHIMS
from shampoo_conformance.thirdparty.optax_shampoo_deviations import compat, deviations
from shampoo_conformance.thirdparty.registry import LibraryRun
from shampoo_spec import (
    CoupledNewtonConfig,
    Inexpressible,
    ShampooConfig,
    config_differences,
    from_google,
    to_google,
)
from shampoo_spec.anchors.google.keys import KEYS as GOOGLE_KEYS

SRC = "optax_shampoo/distributed_shampoo.py"
#: Parameter dtypes this backend runs: float64 under 64-bit JAX, float32 without it.
dtypes = (np.float64, np.float32)
#: ``distributed_shampoo``'s keyword arguments, and precondition's that it lacks.
KEYS = frozenset(inspect.signature(ds.distributed_shampoo).parameters)
MISSING = frozenset(GOOGLE_KEYS - KEYS - {"preconditioner_type"})
#: What a user must pass: ``learning_rate`` and ``block_size`` (required positional;
#: 128 is the block size its docstring advises, :1032-1035).
USER_KWARGS: dict[str, Any] = {"learning_rate": 0.01, "block_size": 128}


# ------------------------------------------------------------------ kwargs <-> config
def _lr_times_wd(kwargs: Mapping[str, Any]) -> bool:
    """Whether its decoupled weight decay is scaled by the learning rate twice (:2278)."""
    return bool(kwargs.get("decoupled_weight_decay", False)) and bool(
        kwargs.get("decoupled_learning_rate", True)) and kwargs.get("weight_decay", 0.0) != 0


def _refusals(kwargs: Mapping[str, Any]) -> list[str]:
    out = [f"{key} (precondition's argument; optax-shampoo 0.0.6 has none)"
           for key in sorted(MISSING & set(kwargs))]
    graft, side = kwargs.get("graft_type"), kwargs.get("precondtioner_type")
    if graft in ("NONE", 0):
        out.append("graft_type NONE (its GraftingType has none, "
                   f"{SRC}:251-257)")
    if side in ("OUTPUT", 3):
        out.append(f"precondtioner_type OUTPUT (its PreconditionerType has none, {SRC}:260-265)")
    if "preconditioner_type" in kwargs:
        out.append("preconditioner_type (it spells the keyword precondtioner_type)")
    if _lr_times_wd(kwargs) and callable(kwargs.get("learning_rate")):
        out.append("decoupled_weight_decay with a learning-rate schedule (its decay is "
                   f"lr_t^2 * weight_decay, {SRC}:2278-2283: no config says that)")
    return out


def from_optax_shampoo(kwargs: Mapping[str, Any], x64: bool | None = None) -> ShampooConfig:
    """The config ``optax_shampoo.distributed_shampoo(**kwargs)`` runs (JSON form).

    ``from_google``'s rules with optax-shampoo's four own (module docstring);
    an argument it lacks raises :class:`Inexpressible`, an unknown one ValueError.
    """
    unknown = set(kwargs) - KEYS - MISSING - {"preconditioner_type"}
    if unknown:
        raise ValueError(f"optax-shampoo's distributed_shampoo has no argument "
                         f"{sorted(unknown)} (TypeError there)")
    lacks = _refusals(kwargs)
    if lacks:
        raise Inexpressible("optax-shampoo 0.0.6 cannot take: " + "; ".join(lacks))
    config = from_google(dict(kwargs), x64=x64)
    root = config.root_inverse
    assert isinstance(root, CoupledNewtonConfig)  # no eigh argument
    wd = config.weight_decay
    if _lr_times_wd(kwargs):
        wd = dataclasses.replace(wd, value=config.learning_rate * wd.value)
    return dataclasses.replace(
        config,
        root_inverse=dataclasses.replace(root, retries=0),
        epsilon=dataclasses.replace(config.epsilon, relative_floor=1e-6),
        grafting=dataclasses.replace(config.grafting, norm_epsilon=1e-16,
                                     normalize_epsilon=1e-16),
        weight_decay=wd)


#: precondition's defaults of the arguments optax-shampoo lacks.
_GOOGLE_DEFAULTS = {
    "eigh": False, "compression_rank": 0, "frequent_directions": False,
    "average_grad": False, "reset_preconditioner": False, "reuse_preconditioner": False,
    "generate_fd_metrics": False, "decay_preconditioning_compute_steps": False,
    "end_preconditioning_compute_steps": None}


def to_optax_shampoo(config: ShampooConfig) -> dict[str, Any]:
    """optax-shampoo's kwargs (JSON form) for ``config``; :class:`Inexpressible` naming
    what it cannot say. ``from_optax_shampoo(to_optax_shampoo(c), x64) == c``."""
    root, eps, graft = config.root_inverse, config.epsilon, config.grafting
    lacks = []
    if not isinstance(root, CoupledNewtonConfig):
        lacks.append(f"root_inverse.method = {root.method!r} (coupled Newton only: no eigh "
                     "argument)")
    elif root.retries != 0:
        lacks.append(f"root_inverse.retries = {root.retries} (its Newton never retries, "
                     f"{SRC}:515-530)")
    if eps.relative_floor != 1e-6:
        lacks.append(f"epsilon.relative_floor = {eps.relative_floor!r} (1e-6, {SRC}:492)")
    if (graft.norm_epsilon, graft.normalize_epsilon) != (1e-16, 1e-16):
        lacks.append("grafting.norm_epsilon / normalize_epsilon "
                     f"{graft.norm_epsilon!r} / {graft.normalize_epsilon!r} (1e-16, {SRC}:2243)")
    if lacks:
        raise Inexpressible("optax-shampoo 0.0.6 cannot express: " + "; ".join(lacks))
    assert isinstance(root, CoupledNewtonConfig)
    as_google = dataclasses.replace(
        config, root_inverse=dataclasses.replace(root, retries=5, retry_epsilon_factor=10.0,
                                                 retry_error_threshold=0.05),
        epsilon=dataclasses.replace(eps, relative_floor=1e-25),
        grafting=dataclasses.replace(graft, norm_epsilon=1e-25, normalize_epsilon=1e-25))
    try:
        kwargs = to_google(as_google)
    except Inexpressible as err:  # what neither it nor precondition's source says
        raise Inexpressible(f"optax-shampoo 0.0.6 (precondition's rules there): {err}") from err
    for key in sorted(MISSING & set(kwargs)):
        if kwargs[key] == _GOOGLE_DEFAULTS[key]:
            del kwargs[key]
    if _lr_times_wd(kwargs) and config.learning_rate > 0:
        kwargs["weight_decay"] = config.weight_decay.value / config.learning_rate
    lacks = _refusals(kwargs)
    if lacks:
        raise Inexpressible("optax-shampoo 0.0.6 cannot express: " + "; ".join(lacks))
    back = from_optax_shampoo(kwargs, x64=config.factor_dtype == "float64")
    if config_differences(config, back):  # the weight decay's division, at most
        raise Inexpressible("optax-shampoo 0.0.6 cannot express: "
                            f"{config_differences(config, back)}")
    return kwargs


def library_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Its real arguments from the JSON form: enums by name, everything else as is."""
    out = dict(kwargs)
    if isinstance(out.get("graft_type"), str):
        out["graft_type"] = ds.GraftingType[out["graft_type"]]
    if isinstance(out.get("precondtioner_type"), str):
        out["precondtioner_type"] = ds.PreconditionerType[out["precondtioner_type"]]
    return out


# ------------------------------------------------------------------- capabilities
def _kwargs_or_reason(config: ShampooConfig, dtype: Any) -> tuple[dict[str, Any] | None, str]:
    try:
        kwargs = to_optax_shampoo(in_dtype(config, dtype))
    except Inexpressible as err:
        return None, str(err)
    if kwargs.get("shard_optimizer_states"):
        return None, ("shard_optimizer_states (its pjit path needs a device mesh, and "
                      "jax.experimental.pjit.PartitionSpec, which JAX 0.10.2 removed)")
    if kwargs.get("batch_axis_name") is not None:
        return None, "batch_axis_name needs its update inside a pmap; this backend runs one"
    return kwargs, ""


def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why optax-shampoo cannot run ``config`` with ``dtype`` parameters, or None."""
    kwargs, reason = _kwargs_or_reason(config, dtype)
    return reason if kwargs is None else None


def _own(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Google's draw without what optax-shampoo lacks (eigh, compression, NONE, OUTPUT)."""
    out = {k: v for k, v in kwargs.items() if k not in MISSING}
    if out.get("graft_type") == "NONE":
        out["graft_type"] = "SGD"
    if out.get("precondtioner_type") == "OUTPUT":
        out["precondtioner_type"] = "INPUT"
    return out


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs it expresses: Google's drawn kwargs (thirdparty/google.py, whose
    docstring says what they leave out and why) less what it lacks, imported."""
    return draw_kwargs().map(_own).map(functools.partial(from_optax_shampoo, x64=True))


def _config(**kwargs: Any) -> ShampooConfig:
    """A float64 config over a plain base (as google.py's): roots every step from the
    first, absolute epsilon exact in float32, no momentum, SGD graft."""
    base = {"learning_rate": 0.125, "block_size": 8, "beta1": 0.0, "beta2": 1.0,
            "graft_type": "SGD", "start_preconditioning_step": 1,
            "preconditioning_compute_steps": 1, "matrix_epsilon": 2.0**-10,
            "relative_matrix_epsilon": False, "nesterov": False}
    return from_optax_shampoo({**base, **kwargs}, x64=True)


def base_config() -> ShampooConfig:
    """Its config nearest ``ShampooConfig()``, where the suite's fixed laws start."""
    return _config(block_size=1024)


def _case(kwargs: Mapping[str, Any]) -> ShampooConfig:
    kwargs = {("precondtioner_type" if k == "preconditioner_type" else k): v
              for k, v in kwargs.items()}
    if "matrix_epsilon" in kwargs:  # float32 initial statistics (DEVIATIONS)
        kwargs["matrix_epsilon"] = 2.0 ** round(float(np.log2(kwargs["matrix_epsilon"])))
    return _config(**kwargs)


def _expressible_case(kwargs: Mapping[str, Any]) -> bool:
    try:
        _case(kwargs)
    except Inexpressible:
        return False
    return True


#: Google's named argument sets that optax-shampoo takes (all but eigh, no_graft,
#: output_side), over :func:`_config`'s base.
CASES: dict[str, ShampooConfig] = {name: _case(kw) for name, kw in GOOGLE_CASES.items()
                                   if _expressible_case(kw)}

DEVIATIONS = deviations(_config)


def defaults_config() -> ShampooConfig:
    """The config it runs at :data:`USER_KWARGS` (float32: 64-bit JAX off, its default)."""
    return from_optax_shampoo(USER_KWARGS, x64=False)


# ---------------------------------------------------------------------- running
def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> LibraryRun:
    """``distributed_shampoo(**kwargs)`` stepped as a user steps it (unjitted), shimmed."""
    with compat():
        return optax_library_run(ds.distributed_shampoo(**kwargs), params, grads, dtype)


def _init(tx: optax.GradientTransformation, params: Any, dtype: np.dtype[Any]) -> Any:
    """Its initial state; under float64 its float32 arrays cast to float64 (as a float64
    user must: its update otherwise fails on mismatched ``lax.cond`` branches), the
    ``training_metrics`` left float32 as its update makes them."""
    state = tx.init(params)
    if dtype != np.float64:
        return state

    def cast(stats: Any) -> Any:
        floats = jax.tree.map(lambda a: a.astype(jnp.float64) if a.dtype == jnp.float32
                              else a, stats._replace(training_metrics=None))
        return floats._replace(training_metrics=stats.training_metrics)

    return state._replace(stats=jax.tree.map(
        cast, state.stats, is_leaf=lambda s: isinstance(s, ds.ParameterStats)))


def _transformation(config: ShampooConfig, dtype: Any,
                    learning_rate: Any = None) -> optax.GradientTransformation:
    kwargs, reason = _kwargs_or_reason(config, dtype)
    if kwargs is None:
        raise Inexpressible(f"backend 'optax-shampoo': {reason}")
    if learning_rate is not None:
        kwargs["learning_rate"] = learning_rate
    return ds.distributed_shampoo(**library_kwargs(kwargs))


def known_crash(kwargs: Mapping[str, Any], params: Mapping[str, Any]) -> str | None:
    """Why its update crashes on ``params`` (DEVIATIONS), predicted by its own shape
    rules: every statistic 1 x 1, or LOBPCG on statistics of at most 5 k (JAX's
    lobpcg_standard raises). Its INPUT side treats a vector as ALL does, and it has no
    compression rank: google.known_crash's other two do not apply."""
    sizes: list[int] = []
    for value in params.values():
        shape = tuple(int(d) for d in np.shape(value))
        if len(shape) < kwargs.get("skip_preconditioning_rank_lt", 1) or any(
                d > kwargs.get("skip_preconditioning_dim_size_gt", 4096) for d in shape):
            continue
        pre = ds.Preconditioner(
            np.zeros(shape), kwargs["block_size"], kwargs.get("merge_small_dims_block_size", 4096),
            kwargs.get("best_effort_shape_interpretation", True),
            ds.PreconditionerType[kwargs.get("precondtioner_type", "ALL")])
        sizes += [s[0] for s in pre.shapes_for_preconditioners()]
    if sizes and max(sizes) == 1:
        return f"every statistic of the step is 1 x 1 (IndexError, {SRC}:1734)"
    top_k = int(kwargs.get("lobpcg_topk_precondition", 0) or 0)
    if sizes and top_k > 0 and max(sizes) <= 5 * top_k:
        return f"every statistic is at most 5 lobpcg_topk_precondition = {5 * top_k}"
    return None


def run(config: ShampooConfig, params: dict[str, np.ndarray],
        grads: list[dict[str, np.ndarray]], dtype: Any = np.float64
        ) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``, jitted, shimmed."""
    key = np.dtype(dtype)
    check_run_inputs("optax-shampoo", params, grads, key.name)
    kwargs, _ = _kwargs_or_reason(config, key)
    if kwargs is not None and known_crash(kwargs, params) and currently_in_test_context():
        reject()  # a property drawing it skips the example (google.py's rule)
    with compat(), precision(key):
        tx = _transformation(config, key)

        @jax.jit
        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        return library_steps(lambda p: _init(tx, p, key), step, params, grads, key)


@contextlib.contextmanager
def _shimmed_precision(dtype: np.dtype[Any]) -> Iterator[None]:
    with compat(), precision(dtype):
        yield


def _shimmed(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` whose init and update run inside :func:`compat`: a stepper's jitted update
    traces them at its first step, after the stepper's own precision block has closed."""

    def init(params: Any) -> Any:
        with compat():
            return tx.init(params)

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        with compat():
            return tx.update(updates, state, params)

    return optax.GradientTransformation(init, update)


def _adamw_or_shampoo(optimizer: str, config: ShampooConfig | None, dtype: np.dtype[Any],
                      lr: Any, weight_decay: Any) -> optax.GradientTransformation:
    if optimizer == "shampoo":
        assert config is not None
        return _shimmed(_transformation(config, dtype, learning_rate=lambda count: lr))
    return adamw(lr, weight_decay)


def stepper(optimizer: str, params: dict[str, np.ndarray], *, lr: float,
            config: ShampooConfig | None = None, weight_decay: float = 0.0,
            dtype: Any = np.float64) -> Stepper:
    """A closed-loop Stepper: its ``distributed_shampoo`` from ``config`` at rate ``lr``,
    or ``optax.adamw`` (as the jax backend's)."""
    return library_stepper("optax-shampoo", optimizer, params, lr=lr, config=config,
                           weight_decay=weight_decay, dtype=dtype, expressible=expressible,
                           make=_adamw_or_shampoo, init=_init, precision=_shimmed_precision)
