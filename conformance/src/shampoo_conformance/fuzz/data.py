"""Parameter shapes, initial weights and hostile gradient streams.

Shapes are 0-d to 4-d with size-1 dims and, rarely, one large dim
(:data:`LARGE_DIM`); :func:`construction_shapes` adds size-0 dims. A gradient
stream draws, per step and parameter, a *kind* (normal, zeros, sign flip of
the previous gradient, scaled by 1e-30 or 1e3, denormal, huge 1e20, all NaN,
all inf) and up to two *pokes*: single entries set to NaN, +-inf, 1e20,
1e30, 3e38, 1e300, 1e-30, denormals or signed zeros. Values are drawn from a
seeded NumPy generator, so a failing example is reproduced by its seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from numpy.typing import NDArray

import shampoo_spec as ss

Array = NDArray[np.float64]
Stream = list[dict[str, Array]]

#: The large dim of a vector parameter (blocks cut it; skip rules may apply).
LARGE_DIM = 257
#: Entry values a poke writes.
POKES: tuple[float, ...] = (
    math.nan, math.inf, -math.inf, 1e20, -1e20, 1e30, 3e38, 1e300, 1e-30, 5e-324, 1e-40,
    0.0, -0.0,
)
#: Kinds of a whole gradient, weighted toward ordinary ones.
KINDS: tuple[str, ...] = (
    ("normal",) * 6 + ("zeros", "sign_flip", "tiny", "large", "denormal", "huge", "nan", "inf")
)
#: A gradient entry at least this large is refused by the overflow rule of eq. (3) in any
#: block (|B| g^2 > STATE_LIMIT), and the ordinary kinds stay far below it.
HUGE_GRADIENT = 1e20


def dims(allow_zero: bool = False) -> st.SearchStrategy[int]:
    return st.sampled_from([1, 1, 2, 3, 4, 5, 7] + ([0] if allow_zero else []))


@st.composite
def shapes(draw: Any, allow_zero: bool = False, large: bool = True) -> tuple[int, ...]:
    """0-d to 4-d, size-1 dims, product <= 64, or (rarely) a vector of LARGE_DIM."""
    if large and draw(st.integers(0, 39)) == 0:
        large_shape: tuple[int, ...] = draw(st.sampled_from([(LARGE_DIM,), (1, LARGE_DIM)]))
        return large_shape
    shape = tuple(draw(st.lists(dims(allow_zero), min_size=0, max_size=4)))
    while math.prod(shape) > 64:
        shape = shape[1:]
    return shape


def named_shapes(max_params: int = 3, large: bool = True) -> st.SearchStrategy[dict[str, Any]]:
    """``{"p0_...": shape, ...}``: names sort in creation order and are distinctive in errors."""
    return st.lists(shapes(large=large), min_size=1, max_size=max_params).map(
        lambda ss_: {f"p{i}_w{len(s)}d": s for i, s in enumerate(ss_)}
    )


def construction_shapes() -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes for construction only: size-0 dims and a 2000-long dim too."""
    return st.one_of(shapes(allow_zero=True), st.sampled_from([(2000,), (1, 2000), (0,), (3, 0)]))


def initial_params(shapes_: dict[str, tuple[int, ...]], seed: int) -> dict[str, Array]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s) for n, s in shapes_.items()}


def _whole(kind: str, shape: tuple[int, ...], rng: np.random.Generator,
           previous: Array | None) -> Array:
    g = rng.standard_normal(shape)
    if kind == "zeros":
        return np.zeros(shape)
    if kind == "sign_flip":
        return -previous if previous is not None else g
    if kind == "tiny":
        return g * 1e-30
    if kind == "large":
        return g * 1e3
    if kind == "denormal":
        return g * 1e-310
    if kind == "huge":
        return g * HUGE_GRADIENT + np.sign(g) * HUGE_GRADIENT
    if kind == "nan":
        return np.full(shape, math.nan)
    if kind == "inf":
        return np.full(shape, math.inf)
    return g


@dataclass(frozen=True)
class Draw:
    """How one parameter's gradient of one step was made (shown by Hypothesis)."""

    kind: str
    pokes: tuple[tuple[int, float], ...]


@st.composite
def gradient_streams(draw: Any, shapes_: dict[str, tuple[int, ...]], steps: int,
                     hostile: bool = True) -> tuple[Stream, list[dict[str, Draw]]]:
    """``steps`` gradients for ``shapes_``: the arrays and the draws that made them."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    stream: Stream = []
    draws: list[dict[str, Draw]] = []
    previous: dict[str, Array] = {}
    for _ in range(steps):
        step: dict[str, Array] = {}
        made: dict[str, Draw] = {}
        for name, shape in shapes_.items():
            kind = draw(st.sampled_from(KINDS)) if hostile else "normal"
            g = _whole(kind, shape, rng, previous.get(name))
            size = int(np.prod(shape))
            pokes: tuple[tuple[int, float], ...] = ()
            if hostile and size:
                pokes = tuple(draw(st.lists(
                    st.tuples(st.integers(0, size - 1), st.sampled_from(POKES)),
                    max_size=2 if draw(st.integers(0, 3)) == 0 else 0)))
                flat = g.reshape(-1).copy()
                for i, v in pokes:
                    flat[i] = v
                g = flat.reshape(shape)
            step[name] = g
            made[name] = Draw(kind, pokes)
            previous[name] = g
        stream.append(step)
        draws.append(made)
    return stream, draws


def refused_blocks(
    config: ss.ShampooConfig, params: dict[str, Array], grads: dict[str, Array], dtype: Any
) -> dict[str, list[int]]:
    """Per parameter, the blocks eq. (3) must refuse for these gradients.

    A block is refused when its gradient (cast to ``dtype``, after L2 decay)
    holds NaN or inf, or when ``block_overflows`` holds with a zero state
    (the streams keep accepted state far below STATE_LIMIT, see
    :data:`HUGE_GRADIENT`).
    """
    out: dict[str, list[int]] = {}
    wd = config.weight_decay
    for name, g in grads.items():
        w = np.asarray(params[name], dtype=np.float64)
        plan = ss.plan_parameter(w.shape, config)
        with np.errstate(all="ignore"):
            gd = np.asarray(g, dtype=dtype)
            if wd.applies("l2"):
                gd = gd + np.asarray(wd.value, dtype=dtype) * np.asarray(w, dtype=dtype)
            merged = gd.astype(np.float64).reshape(plan.merged_shape)
        bad = []
        for b, block in enumerate(plan.blocks):
            gb = merged[block.slices]
            if gb.size == 0:
                continue
            if not np.all(np.isfinite(gb)) or ss.block_overflows(
                float(np.max(np.abs(gb))), int(gb.size), 0.0
            ):
                bad.append(b)
        out[name] = bad
    return out


__all__ = [
    "HUGE_GRADIENT",
    "KINDS",
    "LARGE_DIM",
    "POKES",
    "Draw",
    "Stream",
    "construction_shapes",
    "gradient_streams",
    "initial_params",
    "named_shapes",
    "refused_blocks",
    "shapes",
]
