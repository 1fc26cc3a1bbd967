"""Data streams and assertions that print what failed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: A matrix in 4 x 4 blocks (remainders included), a vector and a 3-d tensor in blocks:
#: the shapes the per-option tests (KL statistics, averaging) run on with BLOCKED_BASE.
BLOCKED_SHAPES: dict[str, tuple[int, ...]] = {"wide": (6, 9), "vector": (5,), "tensor": (2, 3, 4)}

SHAPES: dict[str, tuple[int, ...]] = {
    "matrix": (7, 10),
    "vector": (7,),
    "tensor": (3, 4, 5),
    "long": (12,),
    "scalar": (),
    "ones": (1, 5, 1),
}


def stream(
    shapes: dict[str, tuple[int, ...]] = SHAPES, steps: int = 20, seed: int = 0
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s) for k, s in shapes.items()} for _ in range(steps)]
    return params, grads


def relative_error(
    got: list[dict[str, np.ndarray]],
    want: list[dict[str, np.ndarray]],
    params: dict[str, np.ndarray],
) -> tuple[float, str]:
    """Worst over steps and parameters of ||got - want|| / ||want - w0||: (error, where)."""
    worst, where = 0.0, ""
    for t, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        for k in w:
            moved = np.linalg.norm(w[k] - params[k])
            err = np.linalg.norm(g[k] - w[k]) / max(moved, 1e-300)
            if not np.all(np.isfinite(g[k])):
                err = np.inf
            if err > worst:
                worst, where = err, f"param {k!r} at step {t}"
    return worst, where


def reference_error(
    config: object, shapes: dict[str, tuple[int, ...]], steps: int, seed: int = 4
) -> tuple[float, str]:
    """:func:`relative_error` of shampoo_jax's float64 run of ``config`` against the
    reference's on one :func:`stream`: (error, where)."""
    from shampoo_conformance.adapters.jax import run as jax_run
    from shampoo_reference import run as reference_run

    params, grads = stream(shapes, steps=steps, seed=seed)
    want = reference_run(config, params, grads)  # type: ignore[arg-type]
    got = jax_run(config, params, grads, dtype=np.float64)  # type: ignore[arg-type]
    return relative_error(got, want, params)


def adam_grafts() -> dict[str, object]:
    """No graft, and Adam's with per-block and per-parameter norms (eq. 18): the grafts
    each preconditioner option is checked under."""
    import shampoo_spec as ss

    return {
        "no_graft": ss.GraftingConfig(),
        "adam_block": ss.GraftingConfig(type="adam", beta2=0.999, bias_correction=True),
        "adam_parameter": ss.GraftingConfig(
            type="adam", beta2=0.999, bias_correction=True, norm_scope="parameter"),
    }


def run_x64(
    make_opt: Callable[[], Any],
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    after: Callable[[Any, Any], Any] | None = None,
) -> tuple[list[dict[str, np.ndarray]], Any, Any]:
    """Jitted float64 steps of the transformation ``make_opt()`` builds, under x64 on the
    CPU: the trajectory, the final state, and ``after(state, params)`` (in x64) or None."""
    import jax
    import jax.numpy as jnp
    import optax

    names = sorted(params)
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        opt = make_opt()

        @jax.jit
        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s

        p = {k: jnp.asarray(params[k], jnp.float64) for k in names}
        s = opt.init(p)
        out = []
        for g in grads:
            p, s = step(p, s, {k: jnp.asarray(g[k], jnp.float64) for k in names})
            out.append({k: np.asarray(v) for k, v in p.items()})
        extra = None if after is None else after(s, p)
    return out, s, extra


def blocked_base() -> object:
    """The config BLOCKED_SHAPES run under: blocks of 4, nothing merged, roots every 2
    steps from step 2, epsilon 1e-6."""
    import shampoo_spec as ss

    return ss.ShampooConfig(
        learning_rate=0.05,
        epsilon=ss.EpsilonConfig(value=1e-6),
        blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
        schedule=ss.ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
    )
