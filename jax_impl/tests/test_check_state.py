"""``check_state`` reads every state kind for NaN or inf and names the parameter.

One test per state kind (graft, Adafactor's moments, filtered gradient,
momentum, graft momentum, diagonal, averaging (Z and Schedule-Free's S_t),
factors, corrected eigenvalues): a real state from ``shampoo(config).init``
and two ``update`` steps of a config that has that kind, one entry of one
parameter's state of that kind set to NaN (or inf); ``check_state`` raises
``ValueError`` naming the kind and the parameter's path, and passes the
clean state. Eager updates (no jit): small shapes, nothing to compile.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shampoo_jax
import shampoo_spec as ss
from shampoo_jax import blocks as B

SHAPES = {"b": (3,), "w": (4, 4)}  # w: four 2 x 2 blocks
BASE = ss.ShampooConfig(
    learning_rate=0.1,
    blocking=ss.BlockingConfig(max_preconditioner_dim=2, merge_dims_up_to=None),
    grafting=ss.GraftingConfig(type="sgd"),
)


def _state(config: ss.ShampooConfig, steps: int = 2) -> Any:
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
    opt = shampoo_jax.shampoo(config)
    state = opt.init(params)
    for _ in range(steps):
        grads = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
        _, state = opt.update(grads, state, params)
    shampoo_jax.check_state(state, config)  # clean: no raise
    return state


def _poison(x: Any, value: float = float("nan")) -> Any:
    flat = np.array(x).reshape(-1)
    flat[flat.size // 2] = value
    return jnp.asarray(flat.reshape(np.shape(x)), x.dtype)


def _poison_leaf(tree: Any, name: str) -> Any:
    """``tree`` (the parameters' structure) with an entry of parameter ``name``'s leaves NaN."""
    return {k: (jax.tree.map(_poison, v) if k == name else v) for k, v in tree.items()}


def _raises(state: Any, config: ss.ShampooConfig, kind: str, path: str = "['w']") -> None:
    pattern = f"{re.escape(kind)}.*{re.escape(path)}"
    with pytest.raises(ValueError, match=pattern) as info:
        shampoo_jax.check_state(state, config)
    other = "['b']" if "['w']" in path else "['w']"
    assert other not in str(info.value)  # only the poisoned parameter is named


@pytest.mark.parametrize(("kind", "field", "config"), [
    ("graft", "graft", dataclasses.replace(BASE, grafting=ss.GraftingConfig(type="adagrad"))),
    ("filtered gradient", "filtered",
     dataclasses.replace(BASE, gradient_filter=ss.GradientFilterConfig(beta1=0.9))),
    ("momentum", "momentum", dataclasses.replace(BASE, momentum=ss.MomentumConfig(momentum=0.9))),
    ("graft momentum", "graft_momentum", dataclasses.replace(
        BASE, momentum=ss.MomentumConfig(momentum=0.9, buffers="separate"))),
    ("diagonal", "diagonal", dataclasses.replace(
        BASE, diagonal=ss.DiagonalPreconditionerConfig(type="adagrad"))),
    ("averaging", "averaged", dataclasses.replace(
        BASE, averaging=ss.IterateAveragingConfig(type="schedule_free", train_interp=0.7))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_elementwise_kind_names_the_parameter(kind: str, field: str,
                                              config: ss.ShampooConfig) -> None:
    state = _state(config)
    assert getattr(state, field) is not None
    _raises(state._replace(**{field: _poison_leaf(getattr(state, field), "w")}), config, kind)
    _raises(state._replace(**{field: _poison_leaf(getattr(state, field), "b")}), config, kind,
            "['b']")


def test_adafactor_graft_names_the_parameter() -> None:
    config = dataclasses.replace(BASE, grafting=ss.GraftingConfig(
        type="adafactor", epsilon_placement="inside_sqrt", epsilon=1e-30))
    state = _state(config)
    assert state.adafactor is not None and state.graft is None
    _raises(state._replace(adafactor=_poison_leaf(state.adafactor, "w")), config, "graft")


def test_schedule_free_power_sum() -> None:
    config = dataclasses.replace(
        BASE, averaging=ss.IterateAveragingConfig(type="schedule_free", train_interp=0.7))
    state = _state(config)
    bad = state._replace(lr_power_sum=jnp.asarray(np.inf, state.lr_power_sum.dtype))
    with pytest.raises(ValueError, match=r"averaging state of parameter\(s\) lr_power_sum"):
        shampoo_jax.check_state(bad, config)


def _block_of_w(state: Any, config: ss.ShampooConfig) -> tuple[int, int]:
    """The group and stack position of w's block at offsets (2, 2)."""
    layout = B.make_layout(state.info.shapes, config)
    gi = next(i for i, grp in enumerate(layout.groups) if grp.shape == (2, 2))
    j = layout.groups[gi].members.index((1, 3))
    return gi, j


def _poison_block(state: Any, gi: int, j: int, field: str, inf: bool = False) -> Any:
    groups = list(state.groups)
    value = getattr(groups[gi], field)

    def one(x: Any) -> Any:
        out = np.array(x)
        out[j].reshape(-1)[0] = np.inf if inf else np.nan
        return jnp.asarray(out, x.dtype)

    groups[gi] = groups[gi]._replace(
        **{field: tuple(one(x) if k == 0 else x for k, x in enumerate(value))
           if isinstance(value, tuple) else one(value)})
    return state._replace(groups=tuple(groups))


def test_factors_name_the_parameter_and_block() -> None:
    state = _state(BASE)
    gi, j = _block_of_w(state, BASE)
    _raises(_poison_block(state, gi, j, "factors", inf=True), BASE,
            "factors", "['w'] (block at offsets (2, 2))")


def test_corrected_eigenvalues_name_the_parameter_and_block() -> None:
    config = dataclasses.replace(BASE, eigenvalue_correction=ss.EigenvalueCorrectionConfig())
    state = _state(config)
    assert state.groups[0].corrected_moment is not None
    gi, j = _block_of_w(state, config)
    _raises(_poison_block(state, gi, j, "corrected_moment"), config,
            "corrected eigenvalues", "['w'] (block at offsets (2, 2))")
