"""Eq. (10g), a parameter's rank cutoff (``epsilon.rank_cutoff_scope="parameter"``):
shampoo_jax against the float64 reference, and sharded against one device.

The streams are those of reference/tests/test_parameter_rank_cutoff.py:
parameters cut into blocks of very different scales, so that eq. (10g)'s
cutoff ``rtol * max_b lambda_max(A_{b,k})`` drops directions of the small
blocks that eq. (10)'s own cutoff keeps (every eigenvalue at least a factor
10 from either cutoff, so no decision is left to rounding). Each test also
checks that the ``"factor"`` scope gives other steps on the same data, so a
backend that ignored the scope, or took the max over the wrong blocks, fails:

- a vector in two diagonal blocks (the closed form: 1 kept, 0 dropped);
- a matrix whose blocks come in two sizes (a remainder block, the largest,
  decomposed in another batch than the small block it cuts), and a second
  parameter of a much smaller scale in the same block group and batches: the
  max must not leak from one parameter into the other;
- a block refused by eq. (3) on a root step takes no part in that step's max;
- the same parameters sharded over 2-4 host devices, with the large and the
  small block of a parameter on different devices (the max is a ``pmax``).

Tolerance: the JAX-vs-reference tests' 1e-9 relative (docs/spec.md section 5,
tests/test_reference_equality.py).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_conformance.adapters.jax import run as jax_run
from shampoo_conformance.suite.rank_cutoff_problems import diagonal_stream, tearfree_shampoo
from shampoo_jax.blocks import make_layout
from shampoo_jax.placement import group_costs, placement
from shampoo_reference import run as reference_run

from .helpers import relative_error
from .sharded_helpers import assert_bitwise, trajectory

TOL = 1e-9


def _config(scope: Literal["factor", "parameter"], block: int = 4, precondition_frequency: int = 1,
            **changes: object) -> ss.ShampooConfig:
    return tearfree_shampoo(scope, block=block, precondition_frequency=precondition_frequency,
                            **changes)


def _both(config: ss.ShampooConfig, params: dict[str, np.ndarray],
          grads: list[dict[str, np.ndarray]]
          ) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], float]:
    """(JAX float64 parameters, reference parameters, worst relative error) per step."""
    got = jax_run(config, params, grads, dtype=np.float64)
    want = reference_run(config, params, grads)
    err, where = relative_error(got, want, params)
    print(f"{config.epsilon.rank_cutoff_scope}: relative error {err:.2e} ({where})")
    return got, want, err


def _diagonal_stream() -> list[dict[str, np.ndarray]]:
    return [{"w": g} for g in diagonal_stream()]


def test_diagonal_blocks_equal_the_reference_and_the_closed_form() -> None:
    params = {"w": np.zeros(8)}
    grads = _diagonal_stream()
    shared, want, err = _both(_config("parameter"), params, grads)
    assert err <= TOL
    own, own_want, own_err = _both(_config("factor"), params, grads)
    assert own_err <= TOL
    # The fourth step's gradient is sqrt(1e-5) on entry 7, eigenvalue 1e-5:
    # (1e-5)^(-1/2) sqrt(1e-5) = 1 kept by eq. (10), 0 dropped by eq. (10g).
    step = [p3["w"] - p4["w"] for p3, p4 in ((shared[2], shared[3]), (own[2], own[3]))]
    assert step[0][7] == 0.0
    assert step[1][7] == pytest.approx(1.0, rel=1e-12)
    np.testing.assert_allclose(step[0][:7], step[1][:7], rtol=1e-12, atol=0.0)


def _scaled_stream(steps: int = 5, seed: int = 7) -> tuple[dict[str, np.ndarray],
                                                           list[dict[str, np.ndarray]]]:
    """``w`` (10, 3) in row blocks of 4, 4 and 2: the first scaled by 1e-4 (eigenvalues
    about 1e-8 of the others'), the remainder (another batch: size 2) by 10, the
    largest; ``u`` (8, 3), the same block shapes as ``w``'s first two, scaled by 1e-3
    throughout (eigenvalues about 1e-6 to 1e-8 of ``w``'s largest, below its cutoff)."""
    rng = np.random.default_rng(seed)
    params = {"w": np.zeros((10, 3)), "u": np.zeros((8, 3))}
    grads = []
    for _ in range(steps):
        w = rng.standard_normal((10, 3))
        w[:4] *= 1e-4
        w[8:] *= 10.0
        grads.append({"w": w, "u": 1e-3 * rng.standard_normal((8, 3))})
    return params, grads


#: Root steps every step or every 2nd; roots taking effect a step late (eq. 8, the
#: refresh after the direction); an EMA with bias correction (eq. 7) and trace
#: scaling (eq. 7b, tau = 1/4: the blocks' eigenvalue ratio 1e-10 becomes 1e-7.5).
VARIANTS: dict[str, dict[str, object]] = {
    "every_step": {},
    "every_2nd": {"schedule": ss.ScheduleConfig(precondition_frequency=2,
                                                period_anchor="start", roots_before_start=True)},
    "next_step": {"schedule": ss.ScheduleConfig(roots_take_effect="next_step",
                                                period_anchor="start", roots_before_start=True)},
    "ema_bias_trace": {"statistics": ss.StatisticsConfig(
        beta2=0.9, bias_correction=True, initial_value="zero", trace_scaling_exponent=0.25)},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parameters_sharing_batches_equal_the_reference(variant: str) -> None:
    params, grads = _scaled_stream()
    config = _config("parameter", **VARIANTS[variant])
    layout = make_layout(((8, 3), (10, 3)), config)  # sorted names: u, w
    # Both parameters' (4, 3) blocks are one block group, so one batch per dim.
    assert any({i for i, _ in grp.members} == {0, 1} for grp in layout.groups)
    got, _, err = _both(config, params, grads)
    assert err <= TOL
    own, _, own_err = _both(_config("factor", **VARIANTS[variant]), params, grads)
    assert own_err <= TOL
    last, own_last = ({k: a[k] - b[k] for k in a} for a, b in ((got[-2], got[-1]),
                                                              (own[-2], own[-1])))
    # The last step, w's small block: eq. (10g) drops every direction (its
    # eigenvalues are below 1e-6 of the remainder block's), eq. (10) keeps them.
    assert np.abs(last["w"][:4]).max() == 0.0
    assert np.abs(own_last["w"][:4]).max() > 1e-3
    # u is its own parameter: w's blocks do not scale its cutoff (they would drop
    # all of it), and its blocks are alike, so the scopes agree on it.
    assert np.abs(last["u"]).max() > 1e-3
    np.testing.assert_allclose(got[-1]["u"], own[-1]["u"], rtol=1e-9, atol=0.0)


def test_a_refused_block_takes_no_part_in_the_max() -> None:
    """Eq. (3): a vector in three diagonal blocks whose factors sum to diag(1e4, ...),
    diag(1, ...) and diag(1e-5, ...), one entry a step. On step 3 the first block's
    gradient has a NaN, so it is skipped and that root step's Lambda is 1 (the second
    block's): the third block's new direction is kept, (1e-5)^(-1/2) sqrt(1e-5) = 1,
    where steps 2 and 4 (Lambda = 1e4) drop it; the reference decides the same."""
    grads = []
    for i in range(4):
        g = np.zeros(12)
        g[i], g[4 + i], g[8 + i] = 100.0, 1.0, np.sqrt(1e-5)
        grads.append({"w": g})
    grads[2]["w"][0] = np.nan
    params = {"w": np.zeros(12)}
    config = _config("parameter", failure=ss.FailureConfig(nonfinite_gradient="skip_block"))
    got, _, err = _both(config, params, grads)
    assert err <= TOL
    before = [params, *got]
    moved = [float(before[t]["w"][8 + t] - got[t]["w"][8 + t]) for t in range(4)]
    assert moved[1] == 0.0 and moved[3] == 0.0  # the first block took part: dropped
    assert moved[2] == pytest.approx(1.0, rel=1e-12)  # it did not: kept


def test_one_block_parameters_do_not_see_the_scope() -> None:
    rng = np.random.default_rng(3)
    params = {"w": np.zeros((4, 3))}
    grads = [{"w": rng.standard_normal((4, 3))} for _ in range(3)]
    own = jax_run(_config("factor"), params, grads, dtype=np.float64)
    shared = jax_run(_config("parameter"), params, grads, dtype=np.float64)
    for a, b in zip(own, shared, strict=True):
        np.testing.assert_array_equal(a["w"], b["w"])


def _sharded_stream() -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """``w`` (16, 3): four (4, 3) blocks, the first scaled by 10, the others by 1e-4
    (eigenvalues about 1e-10 of the first's: eq. 10g drops them, a max over any set
    of them alone keeps them); ``u`` (8, 3) scaled by 1e-3, in the same block group."""
    rng = np.random.default_rng(11)
    params = {"w": np.zeros((16, 3)), "u": np.zeros((8, 3))}
    grads = []
    for _ in range(4):
        w = 1e-4 * rng.standard_normal((16, 3))
        w[:4] *= 1e5
        grads.append({"w": w, "u": 1e-3 * rng.standard_normal((8, 3))})
    return params, grads


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sharded_equals_one_device(n: int) -> None:
    """float32, blocks sharded over n host devices: bitwise the single-device steps (every
    block's work is the single device's and a max has no order), with w's large block on
    another device than some of its small ones, so a max over each device's own blocks
    would keep what eq. (10g) drops; padding (n = 4: 6 blocks in 8 slots) takes no part."""
    config = _config("parameter", factor_dtype="float32")
    params, grads = _sharded_stream()
    layout = make_layout(((8, 3), (16, 3)), config)  # sorted names: u, w
    (grp,) = layout.groups
    want, s1 = trajectory(config, params, grads, None)
    slots = placement((grp.size,), group_costs(s1.groups), n)[0]
    per = -(-grp.size // n)
    device = {member: slot // per for member, slot in zip(grp.members, slots, strict=True)}
    assert device[(1, 0)] != device[(1, 1)]  # w's large block and a small one
    got, _ = trajectory(config, params, grads, n)
    assert_bitwise(got, want)
    assert np.abs(want[-1]["w"][4:]).max() == 0.0  # dropped by eq. (10g)
    assert np.abs(want[-1]["u"]).max() > 1e-4  # u's own Lambda, not w's
    own, _ = trajectory(_config("factor", factor_dtype="float32"), params, grads, n)
    assert np.abs(own[-1]["w"][4:]).max() > 1e-4
