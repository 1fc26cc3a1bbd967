"""The ``jax`` backend: ``shampoo_jax`` NumPy in, NumPy out (the backend contract).

``run(config, params, grads, dtype)`` runs the jitted Shampoo update on the
CPU in ``dtype`` (float32 or float64; float64 enables x64 for the call) with
``factor_dtype`` forced to match, and returns the parameters after each
step. Policies that raise in the reference (``failure.nonfinite_gradient =
"raise"``, ``max_consecutive_root_failures``) raise here too, between
steps, through :func:`shampoo_jax.check_state`.

``stepper(optimizer, params, lr=..., dtype=...)`` is the closed-loop form
used by the backend report: Shampoo or ``optax.adamw``, one jitted update
per NumPy gradient, timed alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
import optax

from shampoo_conformance.adapters.inputs import check_run_inputs, check_stepper_arguments
from shampoo_jax import check_state, shampoo
from shampoo_spec import Inexpressible, ShampooConfig

_DTYPES: dict[np.dtype[Any], Literal["float32", "float64"]] = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
}


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    dt = np.dtype(dtype)
    check_run_inputs("jax", params, grads, dt.name)
    names = sorted(params)
    config = dataclasses.replace(config, factor_dtype=_DTYPES[dt])
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(dt == np.float64), jax.default_device(cpu):
        opt = shampoo(config)

        @jax.jit
        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        p = {k: jax.numpy.asarray(np.asarray(params[k], dtype=dt)) for k in names}
        s = jax.jit(opt.init)(p)
        out = []
        for g in grads:
            gj = {k: jax.numpy.asarray(np.asarray(g[k], dtype=dt)) for k in names}
            p, s_new = step(p, s, gj)
            check_state(s_new, config, previous=s)
            s = s_new
            out.append({k: np.array(v) for k, v in p.items()})
    return out


class Stepper:
    """One optimizer stepped with NumPy gradients: the closed-loop twin of :func:`run`.

    Made by :func:`stepper`. ``step(grads)`` runs one jitted update
    (``optimizer.update`` then ``optax.apply_updates``) and returns the new
    parameters as NumPy arrays; ``last_step_seconds`` is the wall time of
    that jitted call alone, up to ``block_until_ready`` (no host transfers;
    the first call includes compilation). The learning rate and weight
    decay are traced arguments, so one compiled program serves a whole
    learning-rate grid. ``state_bytes()`` is the size of every leaf of the
    optimizer state pytree (padded, stacked blocks included, as stored);
    ``step_with_peak(grads)`` also returns the compiled update's peak
    optimizer bytes.
    """

    def __init__(
        self,
        update: Any,
        state: Any,
        params: dict[str, Any],
        hyper: tuple[Any, Any],
        dtype: np.dtype[Any],
        config: ShampooConfig | None,
    ) -> None:
        self._update = update
        self._state = state
        self._params = params
        self._hyper = hyper
        self._dtype = dtype
        self._config = config
        self.last_step_seconds = float("nan")
        self._peak: int | None = None  # bytes, computed once (-1: no analysis)

    def step(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step with ``grads``; the parameters after it (NumPy, the stepper's dtype)."""
        names = sorted(self._params)
        if set(grads) != set(names):
            raise ValueError(f"grads have keys {sorted(grads)}; the parameters are {names}.")
        for k in names:
            if np.shape(grads[k]) != np.shape(self._params[k]):
                raise ValueError(
                    f"gradient of {k!r} has shape {np.shape(grads[k])}, parameter has "
                    f"{np.shape(self._params[k])}."
                )
        with cpu_precision(self._dtype):
            g = {k: jax.numpy.asarray(np.asarray(grads[k], dtype=self._dtype)) for k in names}
            jax.block_until_ready(g)
            start = time.perf_counter()
            params, state = self._update(self._params, self._state, g, *self._hyper)
            jax.block_until_ready((params, state))
            self.last_step_seconds = time.perf_counter() - start
            if self._config is not None:
                check_state(state, self._config, previous=self._state)
            self._params, self._state = params, state
            return {k: np.array(v) for k, v in params.items()}

    def state_bytes(self) -> int:
        """Bytes of every array leaf of the optimizer state."""
        return _nbytes(self._state)

    def step_with_peak(
        self, grads: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], int | None]:
        """One step (as :meth:`step`) and the optimizer's peak bytes in the compiled update.

        From XLA's buffer assignment of the jitted update
        (``compiled.memory_analysis()``): arguments + outputs + temporaries
        - aliased bytes, less the parameters (in and out), the gradients
        and the two hyperparameter scalars: the state in and out (the
        update does not donate its state, so both are live) plus the
        temporaries at their highest point. Every step runs the same
        program (roots behind ``lax.cond``), so one figure covers root
        steps too. None where the platform gives no analysis.
        """
        if self._peak is None:
            with cpu_precision(self._dtype):
                g = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self._params.items()}
                compiled = self._update.lower(self._params, self._state, g, *self._hyper).compile()
                stats = compiled.memory_analysis()
            if stats is None:
                self._peak = -1
            else:
                whole = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                         + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
                self._peak = whole - 3 * _nbytes(self._params) - _nbytes(self._hyper)
        return self.step(grads), (None if self._peak < 0 else self._peak)


def _nbytes(tree: Any) -> int:
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(tree)))


def cpu_precision(dt: np.dtype[Any]) -> contextlib.ExitStack:
    """x64 on for float64 (as :func:`run`), arrays on the CPU."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.enable_x64(dt == np.float64))
    stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
    return stack


@functools.lru_cache(maxsize=32)
def _jitted_update(optimizer: str, config: ShampooConfig | None) -> Any:
    """One jitted ``(params, state, grads, lr, weight_decay) -> (params, state)`` per config."""

    def update(p: Any, s: Any, g: Any, lr: Any, weight_decay: Any) -> tuple[Any, Any]:
        opt = _transformation(optimizer, config, lr, weight_decay)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(update)


def _transformation(
    optimizer: str, config: ShampooConfig | None, lr: Any, weight_decay: Any
) -> optax.GradientTransformation:
    if optimizer == "shampoo":
        assert config is not None
        return shampoo(config, learning_rate=lambda count: lr)
    return adamw(lr, weight_decay)


def adamw(lr: Any, weight_decay: Any) -> optax.GradientTransformation:
    """The report's AdamW in optax: betas (0.9, 0.999), eps 1e-8 (as torch's)."""
    return optax.adamw(
        learning_rate=lambda count: lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay
    )


def stepper(
    optimizer: str,
    params: dict[str, np.ndarray],
    *,
    lr: float,
    config: ShampooConfig | None = None,
    weight_decay: float = 0.0,
    dtype: Any = np.float64,
) -> Stepper:
    """A :class:`Stepper` for ``"shampoo"`` or ``"adamw"`` on the CPU in ``dtype``.

    ``"shampoo"``: :func:`shampoo_jax.shampoo` with ``config``
    (``ShampooConfig()`` when None), learning rate ``lr`` and ``factor_dtype``
    matched to ``dtype`` (as :func:`run` does); its weight decay is the
    config's (``weight_decay`` must stay 0). ``"adamw"``:
    ``optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)``;
    ``config`` must be None.
    """
    dt = np.dtype(dtype)
    check_run_inputs("jax", params, [], dt.name)
    check_stepper_arguments(optimizer, config, weight_decay)
    if optimizer == "shampoo":
        config = ShampooConfig() if config is None else config
        config = dataclasses.replace(config, factor_dtype=_DTYPES[dt])
    with cpu_precision(dt):
        p = {k: jax.numpy.asarray(np.asarray(params[k], dtype=dt)) for k in sorted(params)}
        state = jax.jit(_transformation(optimizer, config, lr, weight_decay).init)(p)
        hyper = (jax.numpy.asarray(lr, dtype=dt), jax.numpy.asarray(weight_decay, dtype=dt))
    return Stepper(_jitted_update(optimizer, config), state, p, hyper, dt, config)


# ------------------------------------------- shared by the optax libraries' adapters
#: ``(optimizer, config, dtype, lr, weight_decay) -> transformation``: a library's
#: Shampoo (rate ``lr``, traced) for ``"shampoo"``, :func:`adamw` for ``"adamw"``.
MakeTransformation = Callable[[str, ShampooConfig | None, np.dtype[Any], Any, Any], Any]


def library_steps(
    init: Callable[[dict[str, Any]], Any],
    step: Callable[[Any, Any, Any], tuple[Any, Any]],
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: np.dtype[Any],
) -> list[dict[str, np.ndarray]]:
    """An optax library's open loop (the backend contract): ``state = init(params)``, then
    ``params, state = step(params, state, grads)`` per step, in ``dtype`` arrays;
    the parameters after each step as NumPy. Call inside the library's precision."""
    names = sorted(params)
    p = {n: jax.numpy.asarray(np.asarray(params[n], dtype=dtype)) for n in names}
    s = init(p)
    out = []
    for g in grads:
        p, s = step(p, s, {n: jax.numpy.asarray(np.asarray(g[n], dtype=dtype)) for n in names})
        out.append({n: np.array(v) for n, v in p.items()})
    return out


@functools.lru_cache(maxsize=64)
def _library_update(make: MakeTransformation, optimizer: str, config: ShampooConfig | None,
                    dtype: np.dtype[Any]) -> Any:
    """One jitted ``(params, state, grads, lr, weight_decay) -> (params, state)`` per
    library, optimizer, config and dtype."""

    def update(p: Any, s: Any, g: Any, lr: Any, weight_decay: Any) -> tuple[Any, Any]:
        u, s = make(optimizer, config, dtype, lr, weight_decay).update(g, s, p)
        return optax.apply_updates(p, u), s

    return jax.jit(update)


def library_stepper(
    backend: str,
    optimizer: str,
    params: dict[str, np.ndarray],
    *,
    lr: float,
    config: ShampooConfig | None,
    weight_decay: float,
    dtype: Any,
    expressible: Callable[[ShampooConfig, np.dtype[Any]], str | None],
    make: MakeTransformation,
    init: Callable[[Any, dict[str, Any], np.dtype[Any]], Any],
    precision: Callable[[np.dtype[Any]], Any] = cpu_precision,
) -> Stepper:
    """A closed-loop :class:`Stepper` over an optax library's Shampoo (``make``, with
    ``config`` at rate ``lr``; its weight decay is the config's) or :func:`adamw`;
    ``init(tx, params, dtype)`` builds the library's state. Raises
    :class:`~shampoo_spec.Inexpressible` with ``expressible``'s reason."""
    key = np.dtype(dtype)
    check_run_inputs(backend, params, [], key.name)
    check_stepper_arguments(optimizer, config, weight_decay)
    if optimizer == "shampoo":
        config = dataclasses.replace(ShampooConfig() if config is None else config,
                                     learning_rate=lr)
        reason = expressible(config, key)
        if reason is not None:
            raise Inexpressible(f"backend {backend!r}: {reason}")
    with precision(key):
        p = {k: jax.numpy.asarray(np.asarray(params[k], dtype=key)) for k in sorted(params)}
        tx = make(optimizer, config, key, lr, weight_decay)
        state = init(tx, p, key) if optimizer == "shampoo" else jax.jit(tx.init)(p)
        hyper = (jax.numpy.asarray(lr, dtype=key), jax.numpy.asarray(weight_decay, dtype=key))
    # config=None: the Stepper checks shampoo_jax's state, not the library's.
    return Stepper(_library_update(make, optimizer, config, key), state, p, hyper, key, None)


# ------------------------------------ the registry's user-run hooks (thirdparty/registry.py)
#: What a user passes ``shampoo_jax.shampoo(config, learning_rate=None)``
#: (jax_impl/README.md): the config is required; ``ShampooConfig()`` is the default one.
USER_KWARGS: dict[str, Any] = {"config": ShampooConfig()}


def defaults_config() -> ShampooConfig:
    """``USER_KWARGS``'s config as it is (factors in float32 whatever the parameters)."""
    config: ShampooConfig = USER_KWARGS["config"]
    return config


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any) -> Any:
    """``shampoo(**kwargs)`` stepped as a user steps it, unjitted
    (:func:`~shampoo_conformance.thirdparty.optax_library.optax_library_run`)."""
    from shampoo_conformance.thirdparty.optax_library import optax_library_run

    return optax_library_run(shampoo(**kwargs), params, grads, dtype)


__all__ = ["USER_KWARGS", "Stepper", "cpu_precision", "defaults_config", "library_run",
           "library_stepper", "library_steps", "run", "stepper"]
