"""On CPU the inverse roots are written into the state in place (eqs. 7, 10, 11, 13).

``refresh._roots_in_place`` runs each factor's root one matrix at a
time and writes it into the stored stack; the batched path stacks the factors
of one size and their roots. Both must leave the same state bit for bit:
bias correction and trace scaling (eqs. 7, 7b), roots rounded to
``inverse_root_dtype`` (eq. 11a), a block masked by eq. (3) and a failed root
(eq. 13) keeping their previous inverse roots, and the failure counts. The
point of the in-place path is memory: its root step holds no stack of factors
or roots, which the compiled update's temporaries show.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_jax import refresh, schedule, shampoo

_BLOCKED = {"blocking": ss.BlockingConfig(max_preconditioner_dim=8),
            "schedule": ss.ScheduleConfig(precondition_frequency=2),
            "failure": ss.FailureConfig(nonfinite_gradient="skip_block")}
CONFIGS = {
    "newton, bias-corrected, trace-scaled": ss.ShampooConfig(
        statistics=ss.StatisticsConfig(beta2=0.99, bias_correction=True,
                                       trace_scaling_exponent=0.5),
        epsilon=ss.EpsilonConfig(value=1e-6, scale="relative"),
        root_inverse=ss.CoupledNewtonConfig(), **_BLOCKED),
    "eigh, bfloat16 roots": ss.ShampooConfig(
        epsilon=ss.EpsilonConfig(value=1e-4), inverse_root_dtype="bfloat16", **_BLOCKED),
    "newton that fails": ss.ShampooConfig(
        root_inverse=ss.CoupledNewtonConfig(max_iterations=1, failure_threshold=1e-9),
        **_BLOCKED),
    "eigh, float16 factors": ss.ShampooConfig(
        factor_storage_dtype="float16", epsilon=ss.EpsilonConfig(value=1e-4), **_BLOCKED),
}


_MASKED_STEP = 4


def _run(config: ss.ShampooConfig, in_place: bool, monkeypatch: pytest.MonkeyPatch
         ) -> tuple[list[Any], Any]:
    """Six steps; step 4's gradient of ``w`` has a NaN in one block, on a root step, so
    the masked block's root is skipped and kept."""
    monkeypatch.setattr(refresh, "_writes_roots_in_place",
                        lambda config, groups: in_place)
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((16, 12)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal(24), jnp.float32),
              "v": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)}
    opt = shampoo(config)
    update = jax.jit(opt.update)
    state = opt.init(params)
    outs = []
    for t in range(6):
        g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        if t + 1 == _MASKED_STEP:
            g["w"][0, 0] = np.nan
        u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
        outs.append(u)
    return outs, state


@pytest.mark.parametrize("name", list(CONFIGS))
def test_in_place_roots_equal_the_batched_ones_bit_for_bit(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = CONFIGS[name]
    groups = shampoo(config).init({"w": jnp.zeros((16, 12))}).groups
    assert jax.default_backend() == "cpu"
    assert refresh._writes_roots_in_place(config, groups)
    assert schedule.is_root_step(jnp.asarray(_MASKED_STEP), config.schedule, 1.0)
    outs, state = _run(config, True, monkeypatch)
    want_outs, want = _run(config, False, monkeypatch)
    got_leaves, got_def = jax.tree.flatten((outs, state))
    want_leaves, want_def = jax.tree.flatten((want_outs, want))
    assert got_def == want_def
    for a, b in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(state.skipped_blocks) >= 1  # the masked block was exercised
    if name == "newton that fails":
        assert int(state.root_failures) > 0  # so was eq. (13)'s fallback
    else:
        assert int(state.root_failures) == 0
        # Roots were computed: not the identity they start from.
        x = np.asarray(state.groups[0].inverse_roots[0], np.float32)
        assert not np.allclose(x, np.eye(x.shape[-1]))


def test_the_root_step_holds_no_stack_of_factors_or_roots(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four 256 x 256 blocks, two factors each: eight roots (one stack of them: 2 MiB).
    Batched, the root step holds the stacked factors and the stacked roots; in place,
    neither (XLA's memory analysis of the compiled update). XLA overlaps part of them
    with other temporaries, so the saving asserted is one and a half stacks, not two
    (measured: 1.87)."""
    config = ss.ShampooConfig(root_inverse=ss.CoupledNewtonConfig(),
                              blocking=ss.BlockingConfig(max_preconditioner_dim=256))
    params = {"w": jnp.zeros((512, 512), jnp.float32)}
    opt_state = shampoo(config).init(params)
    stack = 8 * 256 * 256 * 4

    def temp(in_place: bool) -> int:
        monkeypatch.setattr(refresh, "_writes_roots_in_place",
                            lambda config, groups: in_place)
        opt = shampoo(config)
        mem = jax.jit(opt.update).lower(params, opt_state, params).compile().memory_analysis()
        return int(mem.temp_size_in_bytes)

    batched, in_place = temp(False), temp(True)
    assert in_place <= batched - 1.5 * stack, (in_place, batched)
