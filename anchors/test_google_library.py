"""Google's real ``distributed_shampoo`` against ``shampoo_jax`` on a small real model.

What is compared: Google's optax transformation
``precondition.distributed_shampoo.distributed_shampoo(**kwargs)`` (the
non-sharded path, 64-bit JAX) and ``shampoo_jax.shampoo(from_google(kwargs,
x64=True))``, each training the same 64-16-10 tanh MLP on standardized
scikit-learn digits (float64, softmax cross-entropy) from the same initial
weights over the same 50 minibatches of 64. Each optimizer computes its own
gradients (``jax.grad``) at its own weights, so any difference feeds back
into the trajectory as it would in training. Per case the test asserts, over
every step and parameter, ``||w_google - w_ours||_inf / max(||w_google||_inf,
1e-30) <= 1e-8``.

Why 1e-8: both run the same float64 algorithm, so the trajectories differ by
rounding only (XLA vs XLA, sums and matmuls in another order), amplified by
the training dynamics and the inverse roots; measured, 2e-12 at worst, most
cases 1e-15 to 1e-14. 1e-8 leaves room for other CPUs and XLA versions, while
a rule that differs (a step off by one, a missing factor, an epsilon in
another place) moves the weights by far more. The tolerance needs a
trajectory that is not chaotic, hence the learning rate 0.01 (0.001 with no
graft, where the raw Shampoo direction is about 30x a graft's). At 0.1 the
RMSProp, sign and no-graft runs are chaotic: their deviation grows tenfold
every few steps to 1e-2 and beyond by step 50; so does RMSProp with Google's
default beta2 0.999 at 0.01 (its first steps are about 30x lr). Those runs
deviate as much from Google's own run from weights one ulp away (7e-5), and
fed the same gradients both optimizers agree to 6e-15: the dynamics, not
the implementations.

The cases are the kwargs of reference/tests/anchors/test_reference_matches_google.py
(checked there only against an emulator of Google's library), fitted to this
model where a comment says, plus the other arguments docs/migrating.md marks
"same numerics". Two documented departures (docs/spec.md section 3) are
taken out of the comparison, not tolerated:

- relative epsilon: Google takes lambda_max from a power iteration, we take
  the exact one. Every case runs ``relative_matrix_epsilon=False`` (Google's
  default is True); one case keeps it on and is an expected failure (3.7e-7;
  with Google's power iteration replaced by the exact lambda_max, 4e-15).
- initial statistics: Google builds ``matrix_epsilon * I`` in float32 even
  under x64. Its state is cast to float64 after ``init`` (it cannot update
  float64 gradients otherwise; ``training_metrics`` stay float32, as it keeps
  producing them) and the statistics are set to ``matrix_epsilon * I`` in
  float64, as ours start. Left in float32 they would move the trajectories
  by 1e-10, five orders above the rounding this test otherwise sees.

Install (a private environment; Google's package is a test fixture, never a
project dependency)::

    pip install --no-deps ../shared/thirdparty/precondition-239a8cd.tar.gz \\
        chex==0.1.92 flax==0.12.8 toolz==1.2.0 msgpack==1.2.4 rich==15.0.0 \\
        pyyaml==6.0.3 typing-extensions==4.16.0

(flax's own dependencies orbax-checkpoint, tensorstore and treescope are not
needed: Google imports only ``flax.struct``.) Run::

    nox -s "anchors(library='google')"
    # or, in that environment:
    OPENBLAS_NUM_THREADS=1 \\
    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" \\
        python -m pytest -p no:cacheprovider anchors/test_google_library.py -q

Two compiled programs per case (each library's 50 steps in one jitted
``lax.scan``); the XLA flags make compiling them about fivefold cheaper. On
one core the file takes about 70 s with the flags, 260 s without.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, NamedTuple

import pytest

INSTALL = (
    "needs Google's library; from the repository root: pip install --no-deps "
    "../shared/thirdparty/precondition-239a8cd.tar.gz chex==0.1.92 flax==0.12.8 "
    "toolz==1.2.0 msgpack==1.2.4 rich==15.0.0 pyyaml==6.0.3 typing-extensions==4.16.0"
)
ds = pytest.importorskip("precondition.distributed_shampoo", reason=INSTALL)

# Two host devices for the pmap case (batch_axis_name), set before JAX starts;
# every other case runs on the first device, as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()

import jax  # noqa: E402

# Google computes its roots in float64 exactly when 64-bit JAX is on; so do we (x64=True).
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import shampoo_jax  # noqa: E402
import shampoo_spec as ss  # noqa: E402
from shampoo_conformance.thirdparty.anchor_cases import GOOGLE_CASES  # noqa: E402
from shampoo_conformance.thirdparty.google import google_init, google_kwargs  # noqa: E402
from shampoo_spec import from_google  # noqa: E402

STEPS = 50
BATCH = 64
HIDDEN = 16
TOLERANCE = 1e-8

Params = dict[str, jax.Array]
Kwargs = dict[str, object]

# block_size 32 (the emulator test's 128 would hold this model in a few 128 x 128
# blocks, each case several times slower): Google merges the (64, 16) weight into
# a 1024-vector, 32 blocks of 32 with root 2.
BASE: Kwargs = {"learning_rate": 0.01, "block_size": 32, "relative_matrix_epsilon": False}

# Google's argument sets (one list for the emulator test, this test and the google
# conformance backend): shampoo_conformance.thirdparty.anchor_cases.GOOGLE_CASES.
CASES: dict[str, Kwargs] = GOOGLE_CASES

# Other "same numerics" rows of docs/migrating.md's inventory.
INVENTORY: dict[str, Kwargs] = {
    "beta1_diagonal_epsilon": {"graft_type": "ADAGRAD", "beta1": 0.5, "diagonal_epsilon": 1e-4},
    # 64: the weights stay 2-D, (64, 16) in blocks (32, 16) with two factors each, root 4.
    "merge_small_dims_64": {"graft_type": "ADAGRAD", "merge_small_dims_block_size": 64},
    # INPUT on a 1-D parameter fails inside Google's library (an assertion in
    # _preconds_for_grad), hence skip_preconditioning_rank_lt=2: the biases take the graft.
    "input_side_rank_lt_2": {
        "graft_type": "ADAGRAD",
        "merge_small_dims_block_size": 1,
        "preconditioner_type": "INPUT",
        "skip_preconditioning_rank_lt": 2,
    },
    # The Newton errors here range from 1e-12 to 1e-6: at 1e-9 some roots are
    # kept and some rejected (the previous root stays), a decision per root.
    "inverse_failure_threshold": {"graft_type": "ADAGRAD", "inverse_failure_threshold": 1e-9},
    # Size-1 dims kept (the (1, n) biases: a 1 x 1 and an n x n factor, root 4) and
    # nothing merged; the same kwargs with True squeeze them ((n,), root 2).
    "no_shape_interpretation": {"graft_type": "ADAGRAD", "best_effort_shape_interpretation": False},
    "shape_interpretation_row_biases": {"graft_type": "ADAGRAD"},
}
#: The cases run on the model whose biases are (1, n) rows.
ROW_BIASES = {"no_shape_interpretation", "shape_interpretation_row_biases",
              "scalar_without_factor"}
# skip_preconditioning_rank_lt 0: the 0-d scale is preconditioned with no factor
# (blocking.scalar_factor = False). Without a graft that direction is the gradient
# itself (a 1 x 1 factor would make it sign(g)); with one both rescale to the graft.
INVENTORY["scalar_without_factor"] = {
    "graft_type": "NONE", "start_preconditioning_step": 0, "learning_rate": 0.001,
    "skip_preconditioning_rank_lt": 0,
}
# The eigh path's power iteration (floor 1e-6 under lambda_max instead of Newton's 1e-25).
INVENTORY["eigh_relative_epsilon"] = {
    "graft_type": "ADAGRAD", "eigh": True, "relative_matrix_epsilon": True,
}
# No graft with momentum and a delayed start: Google keeps its two buffers (eq. 20,
# buffers="separate"), the Shampoo one gathering the unscaled direction during the SGD
# warm-up; one shared buffer (as imported before) deviated by 8.8e-2 relative within
# 2 steps (the google conformance backend's first finding, docs/third-party.md).
INVENTORY["no_graft_momentum_delayed_start"] = {
    "graft_type": "NONE", "start_preconditioning_step": 4, "learning_rate": 0.001,
}
# Google judges eigh roots by inverse_failure_threshold too (docs/spec.md eq. 13): at
# 1e-30 it rejects every one (their errors are about 1e-20 here) and keeps the identity.
INVENTORY["eigh_inverse_failure_threshold"] = {
    "graft_type": "ADAGRAD", "eigh": True, "inverse_failure_threshold": 1e-30,
}

#: Eq. (11d): LOBPCG deflation where Google's is well defined (docs/third-party.md):
#: every statistic of one size. Blocks of 16, nothing merged, the biases graft-only and
#: the INPUT side: each block's statistic is its first dim's, 16 > 5k. LOBPCG's default
#: k iterations leave the pairs far from converged (Google then rejects many roots,
#: and so must we); 20 iterations converge them, and the deflated root is then the
#: plain root (INVENTORY: no control can tell them apart at 1e-6).
DEFLATED: Kwargs = {
    "graft_type": "ADAGRAD", "block_size": 16, "merge_small_dims_block_size": 1,
    "skip_preconditioning_rank_lt": 2, "preconditioner_type": "INPUT",
    "lobpcg_topk_precondition": 2,
}
DEFLATED_ONE_ITERATION: Kwargs = {**DEFLATED, "lobpcg_topk_precondition": 3,
                                  "lobpcg_max_iter": 1}
DEFLATED_RELATIVE: Kwargs = {**DEFLATED, "graft_type": "RMSPROP", "beta2": 0.95,
                             "relative_matrix_epsilon": True}
INVENTORY["lobpcg_converged"] = {**DEFLATED, "lobpcg_max_iter": 20}

# Eq. (20b): best_effort_memory_usage_reduction without batch_axis_name quantizes the
# momentum buffers (beta1 0.9, both of them) of the two weights to int8; the biases stay
# float. Under x64 Google's buffers, and so its scales, are float64 (from_google(x64=True):
# scale_dtype "float64"); a float32 run would quantize in float32 (test below).
INVENTORY["int8_momentum"] = {"graft_type": "ADAGRAD", "best_effort_memory_usage_reduction": True}
INVENTORY["int8_momentum_sgd_moving_average"] = {
    "best_effort_memory_usage_reduction": True, "beta1": 0.5,
    "moving_average_for_momentum": True, "nesterov": False,
}

# Google's default: lambda_max by its power iteration (epsilon.lambda_max =
# "power_iteration", eq. 9b), which on this model is far from the exact value.
RELATIVE_EPSILON = pytest.param(
    "relative_epsilon", {"graft_type": "ADAGRAD", "relative_matrix_epsilon": True}
)

class Problem(NamedTuple):
    """The initial weights and the minibatches, ``xs`` (steps, batch, 64), ``ys`` (steps, batch)."""

    params: Params
    xs: jax.Array
    ys: jax.Array


@functools.cache
def _problem(row_biases: bool = False) -> Problem:
    """Standardized digits, a fixed order of minibatches and scaled Gaussian weights (seed 0).

    ``row_biases``: the biases as (1, n) rows, so a parameter has a size-1 dim
    (what ``best_effort_shape_interpretation`` decides about).
    """
    digits = load_digits()
    x = digits.data.astype(np.float64)
    std = x.std(axis=0)
    x = (x - x.mean(axis=0)) / np.where(std > 0, std, 1.0)  # some corner pixels are constant
    rng = np.random.default_rng(0)
    epochs = -(-STEPS * BATCH // len(x))
    order = np.concatenate([rng.permutation(len(x)) for _ in range(epochs)])
    batches = order[: STEPS * BATCH].reshape(STEPS, BATCH)
    params = {
        "w1": rng.standard_normal((64, HIDDEN)) / np.sqrt(64),
        "b1": np.zeros((1, HIDDEN) if row_biases else HIDDEN),
        "w2": rng.standard_normal((HIDDEN, 10)) / np.sqrt(HIDDEN),
        "b2": np.zeros((1, 10) if row_biases else 10),
    }
    if row_biases:  # and a 0-d logit scale, for the rules about 0-d parameters
        params["scale"] = np.ones(())
    return Problem(
        {k: jnp.asarray(v) for k, v in params.items()},
        jnp.asarray(x[batches]),
        jnp.asarray(digits.target[batches]),
    )


def _loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    logits = (hidden @ params["w2"] + params["b2"]) * params.get("scale", 1.0)
    loss: jax.Array = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss


def _trajectory(tx: optax.GradientTransformation, state: Any, problem: Problem) -> Params:
    """The weights after each step, stacked: ``{name: (STEPS, *shape)}``.

    All steps run in one jitted ``lax.scan``: one compiled program per case and
    library, and no per-step dispatch.
    """

    def step(carry: tuple[Params, Any], batch: tuple[jax.Array, jax.Array]) -> Any:
        params, state = carry
        grads = jax.grad(_loss)(params, *batch)
        updates, new_state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return (params, new_state), params

    def run(params: Params, state: Any, xs: jax.Array, ys: jax.Array) -> Params:
        trajectory: Params = jax.lax.scan(step, (params, state), (xs, ys))[1]
        return trajectory

    trajectory: Params = jax.jit(run)(problem.params, state, problem.xs, problem.ys)
    return trajectory


def _worst_relative_deviation(theirs: Params, ours: Params) -> float:
    """Max over steps and parameters of ``||a - b||_inf / max(||a||_inf, 1e-30)``."""
    worst = 0.0
    for name, a_steps in theirs.items():
        a = np.asarray(a_steps).reshape(STEPS, -1)
        b = np.asarray(ours[name]).reshape(STEPS, -1)
        scale = np.maximum(np.abs(a).max(axis=1), 1e-30)
        worst = max(worst, float((np.abs(a - b).max(axis=1) / scale).max()))
    return worst


@pytest.mark.parametrize(
    ("name", "case"),
    [*CASES.items(), *INVENTORY.items(), RELATIVE_EPSILON],
    ids=[*CASES, *INVENTORY, "relative_epsilon"],
)
def test_google_library_matches_shampoo_jax(name: str, case: Kwargs) -> None:
    kwargs = {**BASE, **case}
    problem = _problem(row_biases=name in ROW_BIASES)
    google = ds.distributed_shampoo(**google_kwargs(kwargs))
    eps = kwargs.get("matrix_epsilon", 1e-6)
    assert isinstance(eps, float)
    theirs = _trajectory(google, google_init(google, problem.params, eps), problem)
    ours_tx = shampoo_jax.shampoo(from_google(kwargs, x64=True))
    ours = _trajectory(ours_tx, ours_tx.init(problem.params), problem)
    worst = _worst_relative_deviation(theirs, ours)
    print(f"{name}: worst relative deviation {worst:.2e}")  # shown with -s or -rP
    assert worst <= TOLERANCE, f"{name}: worst relative deviation {worst:.2e}"


# ---------------------------------------------------------------- distribution
# Google's pjit path (shard_optimizer_states=True) takes a step's direction from
# the roots in its state and refreshes them after it: schedule.roots_take_effect
# = "next_step" (docs/spec.md eq. 8). The JSON kwargs' partition specs are lists.
SHARDED: dict[str, Kwargs] = {
    "sharded_states": {"graft_type": "ADAGRAD", "start_preconditioning_step": 0},
    "sharded_states_frequency": {
        "graft_type": "ADAGRAD",
        "preconditioning_compute_steps": 3,
        "start_preconditioning_step": 2,
        "statistics_partition_spec": [None, None, None],
        "preconditioner_partition_spec": [None, None, None],
    },
}


def _google_sharded_init(fns: Any, params: Params, matrix_epsilon: float) -> Any:
    """Google's pjit-mode state in float64, statistics ``matrix_epsilon * I``.

    As :func:`google_init`: the stacked statistics (padded to the largest
    factor) and roots, built in float32 by Google, in float64.
    """
    state = fns.init_fn(params)
    g = state.stats.global_stats
    n, size = g.statistics.shape[:2]
    exact = matrix_epsilon * jnp.broadcast_to(jnp.eye(size, dtype=jnp.float64), (n, size, size))
    return state._replace(stats=state.stats._replace(global_stats=g.replace(
        statistics=exact, preconditioners=g.preconditioners.astype(jnp.float64))))


@pytest.mark.parametrize("name", sorted(SHARDED))
def test_google_sharded_states_match_shampoo_jax(name: str) -> None:
    """shard_optimizer_states=True (one device, num_devices_for_pjit=1) against ours.

    The same kwargs without the lag (roots taking effect the same step) must
    be far from Google's run, or the case could not fail.
    """
    kwargs = {**BASE, **SHARDED[name], "shard_optimizer_states": True, "num_devices_for_pjit": 1}
    problem = _problem()
    google = ds.distributed_shampoo(**google_kwargs(kwargs))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    with jax.set_mesh(mesh):
        state = _google_sharded_init(google.init(None), problem.params, 1e-6)
        theirs = _trajectory(google, state, problem)
    config = from_google(kwargs, x64=True)
    assert config.schedule.roots_take_effect == "next_step"
    ours_tx = shampoo_jax.shampoo(config)
    worst = _worst_relative_deviation(theirs, _trajectory(ours_tx, ours_tx.init(problem.params),
                                                          problem))
    same_step = {k: v for k, v in kwargs.items() if k != "shard_optimizer_states"}
    unlagged_tx = shampoo_jax.shampoo(from_google(same_step, x64=True))
    unlagged = _worst_relative_deviation(
        theirs, _trajectory(unlagged_tx, unlagged_tx.init(problem.params), problem))
    print(f"{name}: worst relative deviation {worst:.2e} (roots the same step: {unlagged:.2e})")
    assert worst <= TOLERANCE, f"{name}: worst relative deviation {worst:.2e}"
    assert unlagged > 1e3 * TOLERANCE, f"{name}: the lag made no difference ({unlagged:.2e})"


def _pmap_trajectories(kwargs: Kwargs, ours: dict[str, optax.GradientTransformation]
                       ) -> dict[str, Params]:
    """Google's and each of ``ours`` inside one ``pmap`` over two devices, 50 steps.

    Each device takes half of every minibatch and the gradients are averaged
    (``pmean``, the caller's job in Google's contract); Google's update gets
    the axis name. Replicas must agree bitwise; returns replica 0's trajectory
    of each (Google's under ``"google"``).
    """
    if jax.device_count() < 2:
        pytest.skip("needs two JAX devices: XLA_FLAGS=--xla_force_host_platform_device_count=2 "
                    "before JAX starts")
    problem = _problem()
    google = ds.distributed_shampoo(**google_kwargs(kwargs))

    def run(tx: optax.GradientTransformation, state: Any, xs: jax.Array, ys: jax.Array) -> Params:
        def step(carry: tuple[Params, Any], batch: tuple[jax.Array, jax.Array]) -> Any:
            params, state = carry
            grads = jax.lax.pmean(jax.grad(_loss)(params, *batch), "batch")
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            return (params, state), params

        trajectory: Params = jax.lax.scan(step, (problem.params, state), (xs, ys))[1]
        return trajectory

    halves = (jnp.stack(jnp.split(problem.xs, 2, axis=1)),
              jnp.stack(jnp.split(problem.ys, 2, axis=1)))

    def replicated(tree: Any) -> Any:  # a leading axis of two: one copy per device
        return jax.tree.map(lambda x: jnp.stack([x, x]), tree)

    eps = kwargs.get("matrix_epsilon", 1e-6)
    assert isinstance(eps, float)
    pmapped = {"google": (google, google_init(google, problem.params, eps)),
               **{who: (tx, tx.init(problem.params)) for who, tx in ours.items()}}
    out = {}
    for who, (tx, state) in pmapped.items():
        go = jax.pmap(functools.partial(run, tx), axis_name="batch")
        trajectory = go(replicated(state), *halves)
        for name, a in trajectory.items():  # the replicas agree bitwise
            np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(a[1]), err_msg=who + name)
        out[who] = {k: v[0] for k, v in trajectory.items()}
    return out


def test_google_pmap_batch_axis_name_matches_shampoo_jax() -> None:
    """batch_axis_name (pmap over two devices): the root work split between them.

    Both optimizers run in the same ``pmap``; Google computes each device's
    share of the roots, ours (imported from the same kwargs) the whole step
    on every device. Replicas must agree and match at <= 1e-8.
    """
    kwargs = {**BASE, "graft_type": "ADAGRAD", "preconditioning_compute_steps": 2,
              "batch_axis_name": "batch"}
    assert from_google(kwargs, x64=True) == from_google(
        {k: v for k, v in kwargs.items() if k != "batch_axis_name"}, x64=True)
    out = _pmap_trajectories(kwargs, {"ours": shampoo_jax.shampoo(from_google(kwargs, x64=True))})
    worst = _worst_relative_deviation(out["google"], out["ours"])
    print(f"batch_axis_name: worst relative deviation {worst:.2e}")
    assert worst <= TOLERANCE, f"batch_axis_name: worst relative deviation {worst:.2e}"


def test_google_pmap_int16_statistics_match_shampoo_jax() -> None:
    """best_effort_memory_usage_reduction with batch_axis_name (eqs. 20b, 20c), 64-bit JAX.

    Google then keeps int8 momentum and int16 statistics and roots with float
    diagonals, in its statistics' dtype (float64 here: its state cast to
    float64 as in every case, :func:`_google_init`); ``from_google`` imports
    both storages with float64 scales. The control, ours with float
    statistics and roots (int8 momentum kept), must be far off.

    block_size 16: 76 statistics, an even number. With an odd number on two
    devices (39 at block_size 32) Google pads its stack with a quantized
    identity built in float32 even under x64, and its update fails on the
    float64 state (:func:`test_google_pmap_int16_statistics_odd_count_fails_in_float64`).
    """
    kwargs = {**BASE, "block_size": 16, "graft_type": "ADAGRAD",
              "preconditioning_compute_steps": 2, "batch_axis_name": "batch",
              "best_effort_memory_usage_reduction": True}
    config = from_google(kwargs, x64=True)
    assert config.statistics.storage == "int16_columnwise_diagonal"
    assert config.statistics.scale_dtype == "float64" and config.momentum.storage == (
        "int8_columnwise")
    floats = dataclasses.replace(config, statistics=dataclasses.replace(
        config.statistics, storage="float", scale_dtype="float32"))
    out = _pmap_trajectories(kwargs, {"ours": shampoo_jax.shampoo(config),
                                      "float_statistics": shampoo_jax.shampoo(floats)})
    worst = _worst_relative_deviation(out["google"], out["ours"])
    control = _worst_relative_deviation(out["google"], out["float_statistics"])
    print(f"int16 statistics: worst relative deviation {worst:.2e}; "
          f"float statistics instead: {control:.2e}")
    assert worst <= TOLERANCE, f"int16 statistics: worst relative deviation {worst:.2e}"
    assert control > CONTROL_GAP, f"int16 statistics: the control deviates by {control:.2e}"


def test_google_pmap_int16_statistics_odd_count_fails_in_float64() -> None:
    """Google's limit under x64 (docs/migrating.md): 39 statistics on two devices.

    ``_pmap_quantized_compute_preconditioners`` pads the stack to a multiple
    of the device count with ``QuantizedValue.from_float_value(jnp.eye(...,
    dtype=jnp.float32), ...)``: float32 diagonals and scales beside the
    float64 ones, and its ``lax.cond`` refuses the mismatched branches.
    Google's own float32 runs (x64 off) are unaffected; ours has no padding.
    """
    kwargs = {**BASE, "graft_type": "ADAGRAD", "preconditioning_compute_steps": 2,
              "batch_axis_name": "batch", "best_effort_memory_usage_reduction": True}
    with pytest.raises(TypeError, match="float32.*float64"):
        _pmap_trajectories(kwargs, {})


# Arguments whose effect the test also proves: each case runs a control, ours with
# that argument removed, which must deviate from Google's run by more than CONTROL_GAP
# (so the case fails if the argument were ignored on both sides).
CONTROL_GAP = 1e-6

#: Eq. (8b): the root period follows an optax schedule. Cosine decay 0.01 -> 0 over the
#: 50 steps with preconditioning_compute_steps 10 and end 25: f = floor((10 + 25 (1 -
#: rho_c)) / 10) * 10, rho_c = (1 + cos(pi c / 50)) / 2, is 10 for counts c < 22, 20 up
#: to 35, 30 from 36: roots at c = 0, 10, 20 only (a constant 10 would add 30 and 40;
#: the test checks that from the spec's schedule). Not optax.linear_schedule: on an
#: int32 count it computes in float32 even under x64, and the two libraries' compiled
#: programs round it differently at some counts (one float32 ulp of lr at count 11,
#: which moves the trajectories by 1.3e-8; fed the same float32 values, 3e-15).
DECAY_SCHEDULE = optax.cosine_decay_schedule(0.01, STEPS)
DECAYING_ROOTS: Kwargs = {
    "graft_type": "ADAGRAD",
    "learning_rate": DECAY_SCHEDULE,
    "preconditioning_compute_steps": 10,
    "decay_preconditioning_compute_steps": True,
    "end_preconditioning_compute_steps": 25,
}
#: Eq. (8b) under optax.linear_schedule 0.01 -> 0 over the 50 steps (issue i46c): x_c =
#: 10 + 23 c / 50 never lands on a multiple of 10 (with end 25 it does, at c = 20 and 40,
#: where the rounding of rho decides the period), f = 10 for c < 22, 20 to c = 43, 30
#: from 44: roots at c = 0, 10, 20, 40 (t = 1, 11, 21, 41; the constant 10 adds 31).
#: Google calls the schedule on its int32 count, on which optax computes in float32
#: even under x64; Google's compiled program and ours then round 1 - c / 50 differently
#: (XLA's CPU code contracts c * 0.02 and the subtraction into one FMA in Google's
#: program, not in ours): lr differs by one float32 ulp at 16 of the 50 counts, which
#: moved this run by 1.3e-8 (the issue's gap; the root steps, 1, 11, 21, 41, were the
#: same on both sides, and fed the same values the runs agree to 2e-15). Here the schedule
#: is called on the count as a float64 (a float64 run's schedule), so both libraries
#: compute lr in float64: 1.9e-15.
def linear_schedule_float64(count: Any) -> Any:
    """``optax.linear_schedule(0.01, 0.0, 50)`` on the count taken as a float64."""
    return LINEAR_SCHEDULE(jnp.asarray(count, jnp.float64))


LINEAR_SCHEDULE = optax.linear_schedule(0.01, 0.0, STEPS)
LINEAR_DECAYING_ROOTS: Kwargs = {
    "graft_type": "ADAGRAD",
    "learning_rate": linear_schedule_float64,
    "preconditioning_compute_steps": 10,
    "decay_preconditioning_compute_steps": True,
    "end_preconditioning_compute_steps": 23,
}
#: Eq. (14d): the RMSPROP graft clipped at rms 2 (its first steps have rms about
#: 1/sqrt(1 - beta2) = 4.5, later ones less: some steps clip, some do not).
CLIPPED_GRAFT: Kwargs = {
    "graft_type": "RMSPROP", "beta2": 0.95, "clip_by_scaled_gradient_norm": 2.0,
}
#: Eq. (8b) at a constant callable rate, as to_google exports a growing period: the
#: ratio is 1 and Google's period is floor(15 / 10) * 10 = 10, not 15.
CONSTANT_CALLABLE: Kwargs = {
    "graft_type": "ADAGRAD",
    "learning_rate": ss.anchors.google.ConstantSchedule(0.01),
    "preconditioning_compute_steps": 15,
    "decay_preconditioning_compute_steps": True,
    "end_preconditioning_compute_steps": 5,
}
#: Eq. (10c): compression_rank 9 compresses every factor of this model (32 x 32 blocks,
#: the 16-bias) but the 10-bias's, which takes the Newton root; -4 keeps the smallest
#: eigenvalues, with the eigh path and Google's relative epsilon (its power iteration).
#: The RMSPROP case takes beta2 0.95, as the rmsprop cases of GOOGLE_CASES: at 0.999
#: its graft-only first steps grow rounding (1e-16 after one step, 6e-14 after five,
#: in Google's run and ours alike), which this trajectory grows to 1.2e-8 over 50 steps
#: without compression, and a kept eigenvector set grows further.
COMPRESSED: Kwargs = {"graft_type": "ADAGRAD", "compression_rank": 9}
COMPRESSED_SMALLEST: Kwargs = {
    "graft_type": "ADAGRAD", "compression_rank": -4, "eigh": True,
    "relative_matrix_epsilon": True,
}
COMPRESSED_RELATIVE: Kwargs = {
    "graft_type": "RMSPROP", "beta2": 0.95, "compression_rank": 4,
    "relative_matrix_epsilon": True, "beta1": 0.5,
}
#: Eqs. (6c), (10d): frequent directions where Google's is well defined (docs/
#: third-party.md): every sketched factor as large as the largest statistic, and each
#: observation spanning more than rank + 1 directions. Blocks of 16, nothing merged,
#: the biases graft-only: w1's (16, 16) blocks and w2's 16-factor are sketched at rank
#: 8, w2's 10-factor (<= rank + 2) takes the Newton root. average_grad needs every
#: parameter preconditioned (Google's state changes structure otherwise, which its
#: lax.scan here refuses): blocks of 32 at rank 14, so only w1's 32-factor is sketched.
SKETCHED: Kwargs = {
    "graft_type": "ADAGRAD", "block_size": 16, "merge_small_dims_block_size": 1,
    "skip_preconditioning_rank_lt": 2, "frequent_directions": True, "compression_rank": 8,
    "reuse_preconditioner": True,
}
SKETCHED_RESET: Kwargs = {**SKETCHED, "reset_preconditioner": True, "beta2": 0.9,
                          "beta1": 0.5}
SKETCHED_RELATIVE: Kwargs = {**SKETCHED, "graft_type": "RMSPROP", "beta2": 0.95,
                             "relative_matrix_epsilon": True}
SKETCHED_AVERAGE: Kwargs = {
    "graft_type": "ADAGRAD", "block_size": 32, "merge_small_dims_block_size": 1,
    "frequent_directions": True, "compression_rank": 14, "reuse_preconditioner": True,
    "average_grad": True, "statistics_compute_steps": 3, "preconditioning_compute_steps": 3,
}
CONTROLLED: dict[str, tuple[Kwargs, tuple[str, ...]]] = {
    "lobpcg": (DEFLATED, ("lobpcg_topk_precondition",)),
    "lobpcg_one_iteration": (DEFLATED_ONE_ITERATION,
                             ("lobpcg_topk_precondition", "lobpcg_max_iter")),
    "lobpcg_relative_rmsprop": (DEFLATED_RELATIVE, ("lobpcg_topk_precondition",)),
    "frequent_directions": (SKETCHED, ("frequent_directions",)),
    "frequent_directions_reset": (SKETCHED_RESET, ("reset_preconditioner",)),
    "frequent_directions_relative_rmsprop": (SKETCHED_RELATIVE, ("frequent_directions",)),
    "frequent_directions_average_grad": (SKETCHED_AVERAGE, ("average_grad",)),
    "compression_rank": (COMPRESSED, ("compression_rank",)),
    "compression_rank_smallest_eigh": (COMPRESSED_SMALLEST, ("compression_rank",)),
    "compression_rank_relative_newton": (COMPRESSED_RELATIVE, ("compression_rank",)),
    "decaying_root_frequency": (DECAYING_ROOTS, ("decay_preconditioning_compute_steps",)),
    "decaying_root_frequency_linear": (
        LINEAR_DECAYING_ROOTS, ("decay_preconditioning_compute_steps",)
    ),
    "decay_at_constant_callable_rate": (
        CONSTANT_CALLABLE, ("decay_preconditioning_compute_steps",)
    ),
    "clip_by_scaled_gradient_norm": (CLIPPED_GRAFT, ("clip_by_scaled_gradient_norm",)),
}


def _ours(kwargs: Kwargs) -> optax.GradientTransformation:
    """``shampoo_jax`` for Google's kwargs; a callable learning rate goes to the backend too."""
    lr = kwargs["learning_rate"]
    return shampoo_jax.shampoo(from_google(kwargs, x64=True),
                               learning_rate=lr if callable(lr) else None)


def test_decaying_root_frequency_changes_the_root_steps() -> None:
    """The decay case is one where the root period does change within the 50 steps."""
    config = from_google({**BASE, **DECAYING_ROOTS}, x64=True)
    s = config.schedule
    assert s.precondition_frequency_growth == 25
    lr_1 = float(DECAY_SCHEDULE(0))
    roots = [t for t in range(1, STEPS + 1)
             if ss.is_root_step(t, s, ss.learning_rate_ratio(float(DECAY_SCHEDULE(t - 1)), lr_1))]
    constant = [t for t in range(1, STEPS + 1) if ss.is_root_step(t, s)]
    assert roots == [1, 11, 21]
    assert constant == [1, 11, 21, 31, 41]
    # A number as learning_rate: Google's decay does not act, nor does ours.
    assert from_google({**BASE, **DECAYING_ROOTS, "learning_rate": 0.01}).schedule == (
        dataclasses.replace(s, precondition_frequency_growth=None)
    )


def test_linear_decay_takes_googles_root_steps() -> None:
    """The linear case's root steps: the spec's (eq. 8b, float64) are Google's own
    ``preconditioning_compute_steps_schedule`` under jit, for the float64 schedule and for
    optax's float32 one alike (x_c is never within rounding of a multiple of 10), and
    differ from the constant period's."""
    s = from_google({**BASE, **LINEAR_DECAYING_ROOTS}, x64=True).schedule
    assert s.precondition_frequency_growth == 23
    rates = [0.01 * (1.0 - c / STEPS) for c in range(STEPS)]
    roots = [t for t in range(1, STEPS + 1)
             if ss.is_root_step(t, s, ss.learning_rate_ratio(rates[t - 1], rates[0]))]
    assert roots == [1, 11, 21, 41]
    assert [t for t in range(1, STEPS + 1) if ss.is_root_step(t, s)] == [1, 11, 21, 31, 41]
    for schedule in (linear_schedule_float64, LINEAR_SCHEDULE):
        period = jax.jit(functools.partial(ds.preconditioning_compute_steps_schedule,
                                           schedule, 10, 23))
        google = [c + 1 for c in range(STEPS) if c % int(period(jnp.int32(c))) == 0]
        assert google == roots


def _member_trajectory(step: Any, params: dict[str, np.ndarray], problem: Problem
                       ) -> dict[str, np.ndarray]:
    """A NumPy/torch member's closed-loop run: ``step(grads, lr) -> params`` each step,
    the gradients by ``jax.grad`` of the same loss at the member's own weights, the
    rate the linear schedule's value at count c (float64)."""
    grad = jax.jit(jax.grad(_loss))
    out: dict[str, list[np.ndarray]] = {k: [] for k in params}
    p = params
    for c in range(STEPS):
        g = grad({k: jnp.asarray(v) for k, v in p.items()}, problem.xs[c], problem.ys[c])
        p = step({k: np.asarray(v) for k, v in g.items()}, float(linear_schedule_float64(c)))
        for k in out:
            out[k].append(np.array(p[k]))
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("member", ["reference", "torch"])
def test_linear_decay_case_on_reference_and_torch(member: str) -> None:
    """The linear case (issue i46c) on the float64 members, against Google's run: each
    takes lr_t per step and forms rho = lr_t / lr_1 in float64 (eq. 8b); measured 1.8e-15
    (reference) and 1.9e-15 (torch). JAX: test_google_library_matches_new_options_and_needs_them."""
    kwargs = {**BASE, **LINEAR_DECAYING_ROOTS}
    problem = _problem()
    google = ds.distributed_shampoo(**google_kwargs(kwargs))
    theirs = _trajectory(google, google_init(google, problem.params, 1e-6), problem)
    config = from_google(kwargs, x64=True)
    params = {k: np.asarray(v) for k, v in problem.params.items()}
    if member == "reference":
        from shampoo_reference import ReferenceShampoo

        ref = ReferenceShampoo(config, params)
        ours = _member_trajectory(ref.step, params, problem)
    else:
        torch = pytest.importorskip("torch")
        from shampoo_torch import Shampoo

        tensors = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float64))
                   for k, v in params.items()}
        opt = Shampoo(list(tensors.items()), config)

        def step(grads: dict[str, np.ndarray], lr: float) -> dict[str, np.ndarray]:
            for k, g in grads.items():
                tensors[k].grad = torch.tensor(g)
            for group in opt.param_groups:
                group["lr"] = lr  # as an LR scheduler sets it; lr_1 is kept at step 1
            opt.step()
            return {k: t.detach().numpy() for k, t in tensors.items()}

        ours = _member_trajectory(step, params, problem)
    worst = _worst_relative_deviation(theirs, ours)
    print(f"{member}: worst relative deviation {worst:.2e}")
    assert worst <= TOLERANCE, f"{member}: worst relative deviation {worst:.2e}"


@pytest.mark.parametrize("name", list(CONTROLLED))
def test_google_library_matches_new_options_and_needs_them(name: str) -> None:
    case, removed = CONTROLLED[name]
    kwargs = {**BASE, **case}
    problem = _problem()
    google = ds.distributed_shampoo(**google_kwargs(kwargs))
    theirs = _trajectory(google, google_init(google, problem.params, 1e-6), problem)
    ours_tx = _ours(kwargs)
    worst = _worst_relative_deviation(theirs, _trajectory(ours_tx, ours_tx.init(problem.params),
                                                          problem))
    control_tx = _ours({k: v for k, v in kwargs.items() if k not in removed})
    control = _worst_relative_deviation(
        theirs, _trajectory(control_tx, control_tx.init(problem.params), problem))
    print(f"{name}: worst relative deviation {worst:.2e}; without {removed}: {control:.2e}")
    assert worst <= TOLERANCE, f"{name}: worst relative deviation {worst:.2e}"
    assert control > CONTROL_GAP, f"{name}: the control deviates by only {control:.2e}"


# ------------------------------------------------- eq. (20b): Google's int8 momentum
def _quantization_inputs(dtype: type, seed: int) -> list[np.ndarray]:
    """Random buffers, and columns made to hit eq. (20b)'s edges.

    Ties: a column c * (127, 0.5, 1.5, 2.5, ...) with c a power of 2 has the
    scale c exactly and every ratio a half-integer. Also a zero column, a
    column whose scale is below the smallest normal number (flushed to 0), a
    negative maximum, and a 3-d buffer (one scale per (dim 1, dim 2) pair).
    """
    rng = np.random.default_rng(seed)
    tiny = float(np.finfo(dtype).tiny)
    ties = np.concatenate([[127.0], np.arange(40) + 0.5, -(np.arange(40) + 0.5)])
    edges = np.stack([
        ties * 2.0**-7,
        np.zeros_like(ties),
        np.where(np.arange(len(ties)) == 3, 50 * tiny, tiny / 3),  # s below tiny: q = 0
        -np.abs(rng.standard_normal(len(ties))) * 1e3,
        rng.standard_normal(len(ties)) * 1e-30,
        np.where(np.arange(len(ties)) == 0, 127 * tiny * 1.0001, tiny * 0.7),  # s just normal
    ], axis=1)
    return [
        rng.standard_normal((64, 16)).astype(dtype),
        (rng.standard_normal((9, 7)) * np.exp(rng.uniform(-20, 20, (1, 7)))).astype(dtype),
        rng.standard_normal((5, 4, 3)).astype(dtype),
        edges.astype(dtype),
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_quantized_integers_equal_googles(dtype: type) -> None:
    """Eq. (20b): the reference stores Google's ``QuantizedValue`` integers and scales, bit for bit.

    Google quantizes in its buffer's dtype (float32; float64 under 64-bit
    JAX); the reference computes each step of the map in that dtype
    (``scale_dtype``), from the same values. Both the integers and the
    scales must be identical, and so the values read back (``to_float``).
    """
    from precondition.quantization_utils import QuantizedValue

    from shampoo_reference.quantization import dequantize_columnwise, quantize_columnwise

    name = np.dtype(dtype).name
    for seed in range(5):
        for x in _quantization_inputs(dtype, seed):
            theirs = QuantizedValue.from_float_value(jnp.asarray(x), jnp.int8)
            q, s = quantize_columnwise(x.astype(np.float64), name)
            assert np.asarray(theirs.quantized).dtype == np.int8
            np.testing.assert_array_equal(np.asarray(theirs.quantized), q)
            assert np.asarray(theirs.bucket_size).dtype == s.dtype
            np.testing.assert_array_equal(np.asarray(theirs.bucket_size), s)
            np.testing.assert_array_equal(
                np.asarray(theirs.to_float()).astype(np.float64), dequantize_columnwise(q, s)
            )


# ------------------------------ eq. (20c): Google's int16 statistics and inverse roots
def _square_quantization_inputs(dtype: type, seed: int) -> list[np.ndarray]:
    """Square matrices as Google's pmap path quantizes them: factors, roots and edges.

    A PSD factor G G^T + eps I (its diagonal dominates its columns), a
    non-symmetric one (a read-back factor plus a Gram matrix is no longer
    symmetric), entries over 40 orders of magnitude, eps I (no off-diagonal:
    scales 0), a 1 x 1, ties (a column c * (32767, 0.5, 1.5, ...), c a power
    of 2: the scale is c and every ratio a half-integer) and a column whose
    off-diagonal maximum is below the smallest normal number (flushed).
    """
    rng = np.random.default_rng(seed)
    tiny = float(np.finfo(dtype).tiny)
    g = rng.standard_normal((24, 40))
    psd = g @ g.T + 1e-6 * np.eye(24)
    nonsym = psd + 1e-5 * rng.standard_normal((24, 24))
    wide = rng.standard_normal((9, 9)) * np.exp(rng.uniform(-20, 20, (1, 9)))
    n = 41
    ties = np.zeros((n, n))
    ties[1:, 0] = np.concatenate([[32767.0], np.arange(20) + 0.5, -(np.arange(19) + 0.5)])
    ties *= 2.0**-15
    ties[:, 1] = rng.standard_normal(n) * tiny / 3  # off-diagonal maximum flushed
    ties[:, 2] = -np.abs(rng.standard_normal(n)) * 1e3
    np.fill_diagonal(ties, 1.0 + rng.uniform(size=n))
    return [x.astype(dtype) for x in (psd, nonsym, wide, 1e-6 * np.eye(7), np.array([[3.0]]),
                                      ties)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_quantized_int16_with_diagonal_equals_googles(dtype: type) -> None:
    """Eq. (20c): the reference stores Google's int16 ``QuantizedValue`` bit for bit.

    ``QuantizedValue.from_float_value(a, jnp.int16, extract_diagonal=True)``
    (Google's pmap path, ``best_effort_memory_usage_reduction`` with
    ``batch_axis_name``, for statistics and inverse roots): integers,
    extracted diagonal, scales and the matrix read back (``to_float``).
    """
    from precondition.quantization_utils import QuantizedValue

    from shampoo_reference.quantization import dequantize_with_diagonal, quantize_with_diagonal

    name = np.dtype(dtype).name
    for seed in range(5):
        for x in _square_quantization_inputs(dtype, seed):
            theirs = QuantizedValue.from_float_value(jnp.asarray(x), jnp.int16,
                                                     extract_diagonal=True)
            q, s, g = quantize_with_diagonal(x.astype(np.float64), name)
            assert np.asarray(theirs.quantized).dtype == np.int16
            np.testing.assert_array_equal(np.asarray(theirs.quantized), q)
            assert np.asarray(theirs.bucket_size).dtype == s.dtype == g.dtype
            np.testing.assert_array_equal(np.asarray(theirs.bucket_size), s)
            np.testing.assert_array_equal(np.asarray(theirs.diagonal), g)
            np.testing.assert_array_equal(
                np.asarray(theirs.to_float()).astype(np.float64), dequantize_with_diagonal(q, s, g)
            )


# ------------------------------------------- combinations, on every backend
#: Options that agreed alone and not together, each a case here (run on the JAX,
#: reference and torch backends against Google's run, and with a control).
#: Eq. (10d), packing "google": rank 4 sketches w2's 10-factor too (10 > 4 + 2), beside
#: the 16-factors (blocks of 16, nothing merged past 16, the biases graft-only); Google
#: packs its sketch at 16 rows, the values in the last 4, and cuts it to 10 rows, so
#: each root step starts that sketch from lambda = 0 (3.1e-2 before from_google said so).
#: The control is the same config with packing "own".
SKETCHED_SMALLER: Kwargs = {
    "graft_type": "ADAGRAD", "block_size": 16, "merge_small_dims_block_size": 16,
    "skip_preconditioning_rank_lt": 2, "frequent_directions": True, "compression_rank": 4,
    "reuse_preconditioner": True,
}


#: Eq. (11d), deflation_padding "google": LOBPCG k = 2 with Google's default relative
#: epsilon, blocks of 16 (w1's 16-factors, w2's 16- and 10-factor), the biases graft-only.
#: Google deflates the 10-factor padded to 16 (10 <= 5k, where a factor alone takes plain
#: Newton) and judges the padding's rows: error 1, every root rejected, the 10-factor's
#: preconditioner stays I (1.1e-1 before from_google said so; relative epsilon off too).
#: The control is the same config with deflation_padding "own".
DEFLATED_SMALLER: Kwargs = {
    "graft_type": "ADAGRAD", "block_size": 16, "merge_small_dims_block_size": 16,
    "skip_preconditioning_rank_lt": 2, "lobpcg_topk_precondition": 2,
    "relative_matrix_epsilon": True,
}


def _own_deflation_padding(config: ss.ShampooConfig) -> ss.ShampooConfig:
    method = config.root_inverse
    assert isinstance(method, ss.CoupledNewtonConfig) and method.deflation_padding == "google"
    return dataclasses.replace(config, root_inverse=dataclasses.replace(
        method, deflation_padding="own"))


def _own_packing(config: ss.ShampooConfig) -> ss.ShampooConfig:
    fd = config.frequent_directions
    assert fd is not None and fd.packing == "google"
    return dataclasses.replace(config, frequent_directions=dataclasses.replace(fd, packing="own"))


COMBINATIONS: dict[str, tuple[Kwargs, Any]] = {
    "frequent_directions_smaller_sketch": (SKETCHED_SMALLER, _own_packing),
    "lobpcg_smaller_factor_relative_epsilon": (DEFLATED_SMALLER, _own_deflation_padding),
}


def _eager_trajectory(step: Any, params: Params, problem: Problem) -> dict[str, np.ndarray]:
    """``{name: (STEPS, *shape)}`` of an eager optimizer: ``step(grads) -> new params``,
    each gradient ``jax.grad`` of the same loss at that optimizer's own weights."""
    grad = jax.jit(jax.grad(_loss))
    out: dict[str, list[np.ndarray]] = {k: [] for k in params}
    w = {k: np.asarray(v) for k, v in params.items()}
    for i in range(STEPS):
        g = {k: np.asarray(v) for k, v in grad(w, problem.xs[i], problem.ys[i]).items()}
        w = step(g)
        for k in out:
            out[k].append(np.asarray(w[k], dtype=np.float64).copy())
    return {k: np.stack(v) for k, v in out.items()}


def _reference_trajectory(config: ss.ShampooConfig, problem: Problem) -> dict[str, np.ndarray]:
    from shampoo_reference import ReferenceShampoo

    opt = ReferenceShampoo(config, {k: np.asarray(v) for k, v in problem.params.items()})
    return _eager_trajectory(opt.step, problem.params, problem)


def _torch_trajectory(config: ss.ShampooConfig, problem: Problem) -> dict[str, np.ndarray]:
    torch = pytest.importorskip("torch")
    import shampoo_torch

    names = list(problem.params)
    tensors = [torch.tensor(np.asarray(problem.params[k]), dtype=torch.float64) for k in names]
    opt = shampoo_torch.Shampoo(tensors, config)

    def step(g: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for k, p in zip(names, tensors, strict=True):
            p.grad = torch.tensor(g[k], dtype=torch.float64)
        opt.step()
        return {k: p.detach().numpy() for k, p in zip(names, tensors, strict=True)}

    return _eager_trajectory(step, problem.params, problem)


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_google_library_combinations_match_every_backend(name: str) -> None:
    case, control_of = COMBINATIONS[name]
    kwargs = {**BASE, **case}
    problem = _problem()
    google = ds.distributed_shampoo(**google_kwargs(kwargs))
    theirs = _trajectory(google, google_init(google, problem.params, 1e-6), problem)
    config = from_google(kwargs, x64=True)
    jax_tx = shampoo_jax.shampoo(config)
    deviations = {
        "jax": _worst_relative_deviation(
            theirs, _trajectory(jax_tx, jax_tx.init(problem.params), problem)),
        "reference": _worst_relative_deviation(theirs, _reference_trajectory(config, problem)),
        "torch": _worst_relative_deviation(theirs, _torch_trajectory(config, problem)),
    }
    control_tx = shampoo_jax.shampoo(control_of(config))
    control = _worst_relative_deviation(
        theirs, _trajectory(control_tx, control_tx.init(problem.params), problem))
    shown = ", ".join(f"{k} {v:.2e}" for k, v in deviations.items())
    print(f"{name}: worst relative deviation {shown}; control {control:.2e}")
    for who, worst in deviations.items():
        assert worst <= TOLERANCE, f"{name}: {who} worst relative deviation {worst:.2e}"
    assert control > CONTROL_GAP, f"{name}: the control deviates by only {control:.2e}"


# ------------------------------------------------- drawn pairs and triples of options
def _load_combinations() -> Any:
    """anchors/combinations.py (a sibling module; the tests import by path)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "anchors_combinations"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(
            "combinations.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


combinations = _load_combinations()

#: The base the named cases are one option set away from (most take the ADAGRAD graft; a
#: case without graft_type has Google's default, SGD: combinations.REMOVE).
COMBINATION_BASE: Kwargs = {**BASE, "graft_type": "ADAGRAD"}
#: The named cases the inventory is taken from: the row-bias model's and the expected
#: failure (relative_epsilon) left out.
COMBINATION_CASES: dict[str, Kwargs] = {
    **{name: {**BASE, **case} for name, case in {**CASES, **INVENTORY}.items()
       if name not in ROW_BIASES},
    **{name: {**BASE, **case} for name, (case, _) in CONTROLLED.items()},
}
COMBINATION_INVENTORY = combinations.inventory(COMBINATION_BASE, COMBINATION_CASES)


def _known_google_gap(kwargs: Kwargs) -> str | None:
    """Draws that hit a gap other work is fixing: xfail(strict=False), the row named.
    None today: the issue's three Google rows are fixed (named cases above)."""
    return None


def _google_does_not_finish(kwargs: Kwargs) -> str | None:
    """Draws Google's library never finishes, so they are not run (a hung XLA computation
    blocks every later one in the process). Found by draw s132: ``eigh=True`` with
    ``compression_rank`` 8, 9 or 10 on this model (blocks of 32: factors of 32, 16 and
    10) leaves a computation that never completes (the next ``jnp.zeros`` waits more
    than 100 s), with or without the relative epsilon; ranks 4 and 14, 9 without
    ``eigh``, and rank 8 or 9 with frequent directions or LOBPCG (draws s11, s18, s24)
    finish (docs/third-party.md, Google)."""
    if kwargs.get("eigh") and kwargs.get("compression_rank") in (8, 9, 10) \
            and not kwargs.get("frequent_directions") \
            and not kwargs.get("lobpcg_topk_precondition"):
        return ("Google's library does not finish eigh=True with compression_rank "
                f"{kwargs['compression_rank']} here (its computation hangs): not run")
    return None


#: A failing draw whose trajectory is chaotic (Google against itself, from w1 scaled by
#: 1 + 1e-15, moves at least 1/CHAOS_FACTOR of our gap) is skipped, not failed: rounding
#: alone explains the gap there. Checked only when a draw fails (no CI cost).
CHAOS_FACTOR = 10.0

#: Gaps the draws found, each now a named case (xfail with its measured gap).
COMBINATION_GAPS: dict[str, tuple[Kwargs, str]] = {}


def _combination_params() -> list[Any]:
    out = []
    for seed, kwargs, test_id, known in combinations.draws(
            "google", COMBINATION_BASE, COMBINATION_INVENTORY, _known_google_gap):
        marks = [pytest.mark.xfail(strict=False, reason=known)] if known else []
        out.append(pytest.param(seed, kwargs, marks=marks, id=test_id))
    for name, (kwargs, reason) in sorted(COMBINATION_GAPS.items()):
        out.append(pytest.param(-1, kwargs, marks=[pytest.mark.xfail(strict=True, reason=reason)],
                                id=f"gap-{name}"))
    return out


@pytest.mark.parametrize(("seed", "kwargs"), _combination_params())
def test_google_combination_matches_shampoo_jax(seed: int, kwargs: Kwargs) -> None:
    """A drawn pair or triple of options (anchors/combinations.py): Google's library decides
    whether it is valid (a refusal, at construction, init or its first trace, skips), then
    the named cases' comparison."""
    print(f"seed {seed}: {combinations.describe(kwargs)}")
    problem = _problem()
    eps = kwargs.get("matrix_epsilon", 1e-6)
    assert isinstance(eps, float)
    hangs = _google_does_not_finish(kwargs)
    if hangs is not None:
        pytest.skip(f"seed {seed}: {hangs}")
    try:
        google = ds.distributed_shampoo(**google_kwargs(kwargs))
        theirs = _trajectory(google, google_init(google, problem.params, eps), problem)
    except (ValueError, TypeError, AssertionError, NotImplementedError, IndexError) as e:
        pytest.skip(f"seed {seed}: Google's library refuses this combination: "
                    f"{type(e).__name__}: {e}")
    try:  # the library accepts it: so must our importer, or document why (a finding)
        ours_tx = _ours(kwargs)
    except NotImplementedError as e:  # "refused today" (docs/migrating.md): documented
        pytest.skip(f"seed {seed}: our importer refuses it, documented: {e}")
    worst = _worst_relative_deviation(theirs, _trajectory(ours_tx, ours_tx.init(problem.params),
                                                          problem))
    print(f"seed {seed}: worst relative deviation {worst:.2e}")
    if worst > TOLERANCE:  # a chaotic draw cannot tell rules apart
        nudged = problem._replace(params={**problem.params,
                                          "w1": problem.params["w1"] * (1.0 + 1e-15)})
        self_gap = _worst_relative_deviation(
            theirs, _trajectory(google, google_init(google, nudged.params, eps), nudged))
        print(f"seed {seed}: Google against itself from w1 scaled by 1 + 1e-15: {self_gap:.2e}")
        if self_gap * CHAOS_FACTOR >= worst:
            pytest.skip(f"seed {seed}: chaotic draw: "
                        f"Google against itself from w1 scaled by 1 + 1e-15 "
                        f"moves {self_gap:.2e}, ours {worst:.2e} from Google")
    assert worst <= TOLERANCE, f"seed {seed}: worst relative deviation {worst:.2e}"
