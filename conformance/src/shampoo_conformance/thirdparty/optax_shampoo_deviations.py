"""What optax-shampoo 0.0.6 needs to run on JAX 0.10.2 (:data:`SHIMS`, :func:`compat`)
and where it differs from the spec (:func:`deviations`, docs/third-party.md).

Kept apart from :mod:`.optax_shampoo` (the adapter) for size; ``deviations``'
``config`` is that module's ``_config`` (its kwargs over a plain base, imported).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from optax_shampoo import distributed_shampoo as ds

from shampoo_conformance.thirdparty.registry import Deviation
from shampoo_spec import ShampooConfig

SRC = "optax_shampoo/distributed_shampoo.py"
#: The shims every run applies to the library's module (module docstring, :func:`compat`).
SHIMS: list[str] = [
    f"jax.tree_map, jax.tree_flatten, jax.tree_unflatten (removed from JAX; {SRC}:1545 "
    "and 35 other calls) -> jax.tree.map, jax.tree.flatten, jax.tree.unflatten",
    f"lax.while_loop: a bool initial carry cast to the body's dtype (coupled Newton's "
    f"error_ratio True, {SRC}:524-527; precondition's source starts it at 1.0)",
]


# ---------------------------------------------------------------------------- shims
class _Namespace(types.ModuleType):
    """``base`` with some attributes replaced: what the library's module sees as ``jax``
    or ``lax`` inside :func:`compat`."""

    def __init__(self, base: types.ModuleType, **replaced: Any) -> None:
        super().__init__(base.__name__)
        self._base = base
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def _while_loop(cond: Any, body: Any, init: Any) -> Any:
    """``lax.while_loop`` with a Python-bool initial carry cast to the body's dtype (the
    loop of ``matrix_inverse_pth_root`` starts its float ``error_ratio`` at ``True``)."""
    out = jax.eval_shape(body, init)
    init = jax.tree.map(lambda a, o: jnp.asarray(a, o.dtype)
                        if isinstance(a, bool) and o.dtype != jnp.bool_ else a, init, out)
    return jax.lax.while_loop(cond, body, init)


_JAX = _Namespace(jax, tree_map=jax.tree.map, tree_flatten=jax.tree.flatten,
                  tree_unflatten=jax.tree.unflatten)
_LAX = _Namespace(jax.lax, while_loop=_while_loop)


@contextlib.contextmanager
def compat() -> Iterator[None]:
    """The library's module runs on JAX 0.10.2 inside this block (:data:`SHIMS`)."""
    saved = ds.jax, ds.lax
    ds.jax, ds.lax = _JAX, _LAX
    try:
        yield
    finally:
        ds.jax, ds.lax = saved


_TESTS = "conformance/tests/test_adapter_optax_shampoo.py::"


def deviations(config: Callable[..., ShampooConfig]) -> tuple[Deviation, ...]:
    """The deviations, their configs built by ``config(**kwargs)``."""
    return (
        Deviation(
            name="removed_jax_apis",
            config=None,
            tests=(),  # every run here is shimmed (optax_shampoo.SHIMS)
            cause=f"it calls jax.tree_map, jax.tree_flatten and jax.tree_unflatten ({SRC}:1545 "
            "and 35 more), which JAX removed (0.6): on JAX 0.10.2 init raises AttributeError: "
            "module 'jax' has no attribute 'tree_map'. The adapter aliases them to jax.tree.* "
            "on the library's module for each run (optax_shampoo.SHIMS); "
            f"{_TESTS}test_unshimmed_library_fails_on_this_jax demonstrates it",
            kind="defect",
        ),
        Deviation(
            name="newton_bool_carry",
            config=None,
            tests=(),  # shimmed (optax_shampoo.SHIMS)
            cause=f"its coupled-Newton loop starts error_ratio at True ({SRC}:524-527) while "
            "its body returns a float: JAX 0.10.2's lax.while_loop raises TypeError (carry "
            "input and output types differ) on every root, so nothing preconditions. The "
            "adapter casts the bool initial carry to the body's dtype (precondition's later "
            f"source starts it at 1.0); {_TESTS}test_unshimmed_library_fails_on_this_jax "
            "demonstrates it",
            kind="defect",
        ),
        Deviation(
            name="float64_update_crash",
            config=None,
            tests=("test_side_effect_float64_stays_float64", "test_library_defaults_float64"),
            cause=f"under 64-bit JAX its init still builds statistics and roots in float32 "
            f"({SRC}:1525-1528), and its update then selects between the new float64 root "
            f"and the old float32 one with lax.cond ({SRC}:1725-1734): TypeError (cond "
            "branches must have equal output types) at the first root step. A float64 user "
            "must cast the state after init, as run() does (optax_shampoo._init, which "
            "keeps float32(matrix_epsilon) I as the initial statistics: configs() and CASES "
            "use epsilons exact in float32)",
            kind="defect",
        ),
        Deviation(
            name="one_by_one_statistics_crash",
            config=config(),
            shapes={"w": (1,)},
            # No pattern: run() rejects such examples in the random properties.
            tests=(),
            cause=f"when every statistic of a step is 1 x 1 (it pads all to the largest, "
            f"{SRC}:1667) its Newton root takes the matrix_size == 1 branch "
            f"({SRC}:511-516) and its update fails cutting the root to the factor's size "
            f"(IndexError, 0-d array, {SRC}:1734): a model whose only preconditioned "
            "parameter has one element. precondition fails there too (UnboundLocalError); "
            "optax_shampoo.known_crash predicts it",
            kind="defect",
        ),
        Deviation(
            name="decoupled_weight_decay_lr_squared",
            config=None,
            tests=(),  # the importer maps it (weight decay lr * weight_decay)
            cause="decoupled_weight_decay=True with decoupled_learning_rate=True (its "
            f"default) decays by lr * (lr * weight_decay) * x ({SRC}:2278-2283: the decay "
            "term lr * wd * x is added before the final multiplication by lr); precondition "
            "fixed it (lr * wd * x, docs/spec.md 4.2). from_optax_shampoo imports it as "
            "weight_decay.value = lr * weight_decay (refused with a learning-rate schedule), "
            f"so the library matches the reference on it; {_TESTS}"
            "test_decoupled_weight_decay_is_scaled_by_lr_twice demonstrates it",
            kind="defect",
        ),
        Deviation(
            name="lobpcg_smaller_factor_root_rejected",
            config=None,
            tests=(),  # configs() does not draw lobpcg_topk_precondition
            cause="its LOBPCG path is precondition's line for line (the google backend's "
            "deviation of this name): it judges each deflated root over the padded matrix "
            f"({SRC}:555-566), so the root of a factor smaller than the largest statistic "
            "of the step always fails at inverse_failure_threshold <= 1; from_google "
            "imports that as deflation_padding='google', which the reference reproduces",
            kind="defect",
        ),
    )


__all__ = ["SHIMS", "compat", "deviations"]
