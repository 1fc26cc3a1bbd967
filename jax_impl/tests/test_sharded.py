"""Sharded block state over 1-4 host devices equals the single-device transformation.

Every operation on the block state is per block and each device runs the
single-device program's ops on its own blocks, so the block work
(``block_step``: statistics, inverse roots, corrected moment, preconditioned blocks)
is compared *bitwise*, uneven block counts included (6 blocks of one shape
on 4 devices are padded to 8).

The whole step's parameters are compared bitwise where the programs round
alike, else within the float bound of docs/spec.md section 5
(``shampoo_conformance.suite.tolerances``). Why they can differ: XLA's CPU
backend always lets LLVM contract ``a * b + c`` into one FMA
(``AllowFPOpFusion = Fast``), and whether it does depends on fusion
boundaries; the sharded program (shard_map, pads, all_gather) fuses the
elementwise ops around them (filter, graft direction, momentum) differently,
so e.g. ``mu * m + (1 - dampening) * p`` may round once or twice: 1 ulp per
such op, with no effect on the algorithm.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shampoo_jax
import shampoo_spec as ss
from shampoo_conformance.suite.divergence import first_divergence
from shampoo_conformance.suite.tolerances import trajectory_bound
from shampoo_jax.blocks import make_layout
from shampoo_jax.placement import group_costs, placement
from shampoo_jax.preconditioner import BlockInputs, block_step
from shampoo_jax.sharded import shard_state, sharded_block_step

from .helpers import stream
from .sharded_helpers import (
    AXIS,
    assert_bitwise,
    mesh_1d,
    padding,
    place,
    sharding_1d,
    trajectory,
    transformation,
)

BASE = ss.ShampooConfig(
    learning_rate=0.1,
    epsilon=ss.EpsilonConfig(value=1e-3),
    grafting=ss.GraftingConfig(type="adagrad"),
    momentum=ss.MomentumConfig(momentum=0.9),
    blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    schedule=ss.ScheduleConfig(precondition_frequency=3, start_preconditioning_step=2),
)
CONFIGS = {
    "eigh": BASE,
    # Coupled Newton (one while_loop over the local stack), parameter-scope
    # grafting, Nesterov, statistics every 2nd step with bias correction.
    "newton": dataclasses.replace(
        BASE,
        root_inverse=ss.CoupledNewtonConfig(tolerance=1e-5, max_iterations=50),
        statistics=ss.StatisticsConfig(beta2=0.99, bias_correction=True),
        grafting=ss.GraftingConfig(type="rmsprop", beta2=0.99, norm_scope="parameter"),
        momentum=ss.MomentumConfig(momentum=0.5, nesterov=True),
        weight_decay=ss.WeightDecayConfig(value=0.01, type="l2"),
        schedule=ss.ScheduleConfig(
            precondition_frequency=2, statistics_frequency=2, start_preconditioning_step=3
        ),
    ),
    # Eq. (13): eigh roots judged by their error; 3e-6 is about the median float32
    # error of these factors, so some roots fail (kept, counted) and some pass.
    "eigh_threshold": dataclasses.replace(
        BASE, root_inverse=ss.EighConfig(failure_threshold=3e-6)
    ),
    # Eigenvalue correction (eq. 17), gradient filter, separate momentum buffers.
    "corrected": dataclasses.replace(
        BASE,
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(beta2=0.95, epsilon=1e-8),
        gradient_filter=ss.GradientFilterConfig(beta1=0.9),
        momentum=ss.MomentumConfig(momentum=0.9, buffers="separate"),
        epsilon=ss.EpsilonConfig(value=1e-3, scale="relative"),
    ),
    # Eq. (17) with w = 1 for D and the factors, uncorrected (Meta's
    # drop_weighting_factor_on_gsquare with eigenvalue correction).
    "corrected_weight_one": dataclasses.replace(
        BASE,
        grafting=ss.GraftingConfig(),  # a graft's rescale would cancel D's weight
        statistics=ss.StatisticsConfig(beta2=0.95, ema_weight="one"),
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(
            beta2=0.95, ema_weight="one", bias_correction=False, epsilon=1e-8),
    ),
    # Roots stored in bfloat16 (eq. 11a), products in bfloat16 (eq. 16).
    "bf16_roots": dataclasses.replace(BASE, inverse_root_dtype="bfloat16"),
    # Factors stored in bfloat16 (eq. 11b), roots in float16, bias-corrected EMA.
    "bf16_factors": dataclasses.replace(
        BASE, factor_storage_dtype="bfloat16", inverse_root_dtype="float16",
        statistics=ss.StatisticsConfig(beta2=0.95, bias_correction=True)),
    # Factors stored in float16 (eq. 11b; eq. 3's float16 limit in the masks).
    "f16_factors": dataclasses.replace(BASE, factor_storage_dtype="float16"),
    # Momentum stored as int8 with float32 scales (eq. 20b).
    "int8_momentum": dataclasses.replace(BASE, momentum=ss.MomentumConfig(
        momentum=0.9, storage="int8_columnwise")),
    # Factors and inverse roots stored as int16 plus their diagonals (eq. 20c),
    # float32 scales; coupled Newton on the read-back factors as they are.
    "int16_statistics": dataclasses.replace(
        BASE,
        root_inverse=ss.CoupledNewtonConfig(tolerance=1e-5, max_iterations=50),
        statistics=ss.StatisticsConfig(storage="int16_columnwise_diagonal"),
    ),
    # Eq. (17a): eigenbases in bfloat16 (rotations in bfloat16), D in float16.
    "corrected_stored_dtypes": dataclasses.replace(
        BASE,
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(
            beta2=0.95, epsilon=1e-4, eigenvectors_dtype="bfloat16",
            corrected_eigenvalues_dtype="float16"),
        gradient_filter=ss.GradientFilterConfig(beta1=0.9),
    ),
    # Eq. (17b): eigenbases kept on some root steps.
    "corrected_basis_reuse": dataclasses.replace(
        BASE,
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(
            beta2=0.95, epsilon=1e-8, basis_reuse_tolerance=0.3),
        schedule=ss.ScheduleConfig(precondition_frequency=1, start_preconditioning_step=2),
    ),
    # Eq. (14b) with w = 1 (Meta's drop_weighting_factor_on_gsquare) and the
    # update rounded to bfloat16 (eq. 21a, Meta's DDP communication_dtype).
    "graft_weight_one_update_bf16": dataclasses.replace(
        BASE, grafting=ss.GraftingConfig(type="adam", beta2=0.9, ema_weight="one"),
        update_dtype="bfloat16",
    ),
    # Eq. (16b): a diagonal preconditioner (rmsprop, with its state V_D) in
    # place of the factors: block groups without factors, rescaled per block
    # to the adagrad graft.
    "diagonal": dataclasses.replace(
        BASE, diagonal=ss.DiagonalPreconditionerConfig(type="rmsprop", beta2=0.99)),
    # Eq. (16b) as Adam: bias-corrected V_D, the filtered gradient, L2 decay
    # into V_D, the parameter-scope rescale, separate momentum buffers.
    "diagonal_adam": dataclasses.replace(
        BASE,
        diagonal=ss.DiagonalPreconditionerConfig(type="adam", beta2=0.99, bias_correction=True),
        grafting=ss.GraftingConfig(type="adagrad", norm_scope="parameter"),
        gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
        momentum=ss.MomentumConfig(momentum=0.9, buffers="separate"),
        weight_decay=ss.WeightDecayConfig(value=0.01, type="l2"),
    ),
    # Eq. (6b): KL-Shampoo statistics, each device preconditioning its own blocks'
    # gradients by the inverse roots it holds (an EMA).
    "kl": dataclasses.replace(BASE, statistics=ss.StatisticsConfig(kl=True, beta2=0.95)),
    # Eq. (20d): Schedule-Free averaging in place of momentum (Z placed like the
    # parameters, S replicated), Z shrunk by the direction decay.
    "schedule_free": dataclasses.replace(
        BASE, momentum=ss.MomentumConfig(),
        averaging=ss.IterateAveragingConfig(type="schedule_free", train_interp=0.8),
        weight_decay=ss.WeightDecayConfig(value=0.01)),
    # Eq. (10f): QR roots from the stored eigenbases (padded with I, sharded, saved).
    "qr_root": dataclasses.replace(
        BASE, root_inverse=ss.EighConfig(eigenbasis_method="qr", qr_max_iterations=2,
                                         qr_tolerance=0.01)),
    # Eq. (10h): eigh roots that keep their stored eigenbasis while it fits (padded with
    # I, sharded, saved); a root every step, so that some rows of a stack keep theirs
    # while others decompose.
    "eigh_basis_reuse": dataclasses.replace(
        BASE, root_inverse=ss.EighConfig(basis_reuse_tolerance=0.3),
        schedule=ss.ScheduleConfig(precondition_frequency=1, start_preconditioning_step=2)),
    # Eq. (10g): pseudo-inverse roots whose rank cutoff is the largest eigenvalue over
    # the parameter's blocks, which sit on several devices (a pmax); masked and
    # padding blocks take no part. rtol 0.3: the scopes cut these factors differently.
    "parameter_rank_cutoff": dataclasses.replace(
        BASE, epsilon=ss.EpsilonConfig(value=0.0, placement="pseudo_inverse", rank_rtol=0.3,
                                       rank_cutoff_scope="parameter")),
    # Eqs. (6c), (10d): frequent-directions sketches of the factors of 4 (rank 1),
    # the averaged gradient sum (placed like the parameters), a reset at step 6,
    # relative epsilon; statistics with the roots, every 3rd step.
    "frequent_directions": dataclasses.replace(
        BASE,
        frequent_directions=ss.FrequentDirectionsConfig(
            rank=1, average_gradients=True, reset_every=5),
        statistics=ss.StatisticsConfig(beta2=0.9),
        epsilon=ss.EpsilonConfig(value=1e-3, scale="relative"),
        schedule=ss.ScheduleConfig(precondition_frequency=3, statistics_frequency=3,
                                   start_preconditioning_step=2),
    ),
}
# Six (4, 4) blocks in one group (uneven over 4 devices), remainders, a
# vector, a scalar (not preconditioned) and a 3-d tensor.
SHAPES = {"w": (12, 10), "v": (9,), "t": (3, 4, 5), "s": ()}
STEPS = 7


@pytest.fixture(scope="module")
def data() -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    return stream(SHAPES, steps=STEPS, seed=3)


def assert_within_bound(
    config: ss.ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    got: list[dict[str, np.ndarray]],
    want: list[dict[str, np.ndarray]],
) -> None:
    """``got`` within the float32 trajectory bound of ``want`` (docs/spec.md section 5)."""
    bound = trajectory_bound(config, params, grads, np.float32)
    div = first_divergence(got, [{k: v.astype(np.float64) for k, v in w.items()} for w in want],
                           params, bound)
    assert div is None, div.describe()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_block_work_is_bitwise_the_single_device_work(
    name: str, data  # noqa: ANN001
) -> None:
    """``block_step`` on each device's shard == on all blocks: bitwise (Newton: its tolerance)."""
    config = CONFIGS[name]
    params, grads = data
    _, s1 = trajectory(config, params, grads[:4], None)  # a state with non-trivial inverse roots
    layout = make_layout(
        tuple(tuple(np.shape(params[k])) for k in sorted(params)), config)
    rng = np.random.default_rng(7)
    stacks = [rng.standard_normal((grp.size, *grp.shape)).astype(np.float32)
              for grp in layout.groups]
    ok = [np.arange(grp.size) % 5 != 1 for grp in layout.groups]  # some blocks masked
    inputs = BlockInputs(
        grads=[jnp.asarray(x) for x in stacks],
        ok=[jnp.asarray(o) for o in ok],
        filtered=[jnp.asarray(1.5 * x) for x in stacks],
        graft=[jnp.asarray(-x) for x in stacks],
    )
    single = jax.jit(lambda g, i, t: block_step(g, i, t, layout, config))
    for n in (2, 3, 4):  # (one device: the whole-step test)
        sh = sharding_1d(n)
        sharded = jax.jit(lambda g, i, t, sh=sh: sharded_block_step(
            g, i, t, layout, config, sh))
        groups = shard_state(s1, sh).groups
        for t in (5, 6):  # a non-root step and a root step (frequency 3 or 2)
            tt = jnp.asarray(t, jnp.int32)
            want = single(s1.groups, inputs, tt)
            got = sharded(groups, jax.device_put(inputs, sh.replicated), tt)
            assert int(got[1]) == int(want[1]), (t, n)
            pairs = list(zip(got[2], want[2], strict=True))
            slots = placement(tuple(grp.size for grp in layout.groups), group_costs(s1.groups), n)
            for ga, gb, sl in zip(got[0], want[0], slots, strict=True):
                pairs += [(np.asarray(a)[list(sl)], b)
                          for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True)]
            for a, b in pairs:
                a, b = np.asarray(a), np.asarray(b)
                if isinstance(config.root_inverse, ss.CoupledNewtonConfig):
                    # Batched, XLA's CPU dot inside the while_loop depends on the
                    # batch size (a stack of 1-3 small matrices takes another
                    # kernel than 4+). One matrix at a time (CPU, since c577d4d)
                    # the roots still differ in the last bits (3.6e-7 here).
                    # Both inverse roots meet the stopping rule max|M - I| <= tolerance,
                    # so they differ by at most ~tolerance / r relative.
                    tol = config.root_inverse.tolerance * max(1.0, float(np.max(np.abs(b))))
                    if config.statistics.quantized:
                        # Eq. (20c): roots that differ that little may still store
                        # integers one apart, a step of max|column| / 32767.
                        tol += float(np.max(np.abs(b))) / 32767
                    np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=f"{t=} {n=}")
                else:
                    np.testing.assert_array_equal(a, b, err_msg=f"{t=} {n=}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sharded_parameters_equal_single_device(name: str, data) -> None:  # noqa: ANN001
    config = CONFIGS[name]
    params, grads = data
    want, s1 = trajectory(config, params, grads, None)
    assert any(not np.array_equal(want[-1][k], params[k]) for k in params)
    if name == "eigh_threshold":  # both decisions of eq. (13) happen
        roots = [np.asarray(x) for gs in s1.groups for x in gs.inverse_roots]
        assert int(s1.root_failures) > 0
        assert any(not np.array_equal(x, np.eye(x.shape[-1])) for r in roots for x in r)
    bitwise = name in ("eigh", "bf16_roots", "int8_momentum", "graft_weight_one_update_bf16",
                       "diagonal", "kl", "frequent_directions", "parameter_rank_cutoff")
    for n in (1, 2, 3, 4):
        got, s = trajectory(config, params, grads, n)
        assert_within_bound(config, params, grads, got, want)
        assert int(s.count) == STEPS
        assert int(s.root_failures) == int(s1.root_failures)
        assert int(s.skipped_blocks) == int(s1.skipped_blocks)
        if bitwise and n > 1:
            # Here the two programs fuse alike (checked on jax 0.10.2): bitwise.
            assert_bitwise(got, want)


def test_state_is_padded_sharded_and_shrinks_per_device(data) -> None:  # noqa: ANN001
    params, _ = data
    one, _ = transformation(BASE, None)
    s1 = one.init(place(params, None))
    for n in (2, 3, 4):
        opt, _ = transformation(BASE, n)
        s = opt.init(place(params, n))
        for ref, gs in zip(s1.groups, s.groups, strict=True):
            nb = ref.statistics_updates.shape[0]
            padded = -(-nb // n) * n
            for x in jax.tree.leaves(gs):
                assert x.shape[0] == padded, (x.shape, nb, n)
                assert x.sharding.spec == jax.sharding.PartitionSpec(AXIS)
                assert {sh.data.shape[0] for sh in x.addressable_shards} == {padded // n}
        # Per-device bytes of the block state: each device holds 1/n of the padded stacks.
        total = sum(x.nbytes for gs in s1.groups for x in jax.tree.leaves(gs))
        dev0 = jax.devices("cpu")[0]
        on_dev0 = sum(
            sh.data.nbytes
            for gs in s.groups
            for x in jax.tree.leaves(gs)
            for sh in x.addressable_shards
            if sh.device == dev0
        )
        padded_total = sum(x.nbytes for gs in s.groups for x in jax.tree.leaves(gs))
        assert on_dev0 * n == padded_total
        assert on_dev0 < total  # the padding never costs more than it saves here
        # Padding: identity factors and inverse roots, zero counters.
        for gs, pad in zip(s.groups, padding(s1.groups, n), strict=True):
            for f in (*gs.factors, *gs.inverse_roots):
                tail = np.asarray(f)[pad]
                eye = np.broadcast_to(np.eye(f.shape[-1]), tail.shape)
                np.testing.assert_array_equal(tail, eye)


def test_padded_blocks_are_not_failures_nor_skipped() -> None:
    # One Newton iteration never reaches 1e-9: every real root fails (eq. 13),
    # and a NaN gradient block is skipped (eq. 3); padding adds neither.
    config = dataclasses.replace(
        BASE,
        root_inverse=ss.CoupledNewtonConfig(max_iterations=1, failure_threshold=1e-9),
        failure=ss.FailureConfig(nonfinite_gradient="skip_block"),
    )
    params, grads = stream({"w": (12, 10), "v": (9,)}, steps=4, seed=5)
    grads[2]["w"][0, 0] = np.nan
    want, s1 = trajectory(config, params, grads, None)
    got, s = trajectory(config, params, grads, 4)
    assert_bitwise(got, want)
    assert int(s.root_failures) == int(s1.root_failures) > 0
    assert int(s.skipped_blocks) == int(s1.skipped_blocks) == 1
    for gs, pad in zip(s.groups, padding(s1.groups, 4), strict=True):
        np.testing.assert_array_equal(np.asarray(gs.consecutive_failures)[pad], 0)
        np.testing.assert_array_equal(np.asarray(gs.statistics_updates)[pad], 0)
        for leaf in jax.tree.leaves(gs):
            assert np.all(np.isfinite(np.asarray(leaf)))
    limited = dataclasses.replace(config, failure=ss.FailureConfig(
        nonfinite_gradient="skip_block", max_consecutive_root_failures=1))
    with pytest.raises(shampoo_jax.RootFailureError):
        shampoo_jax.check_state(s, limited)


@pytest.mark.parametrize(("before", "after", "name"),
                         [(2, 3, "eigh"), (4, 1, "eigh"), (None, 4, "eigh"),
                          (3, 2, "int8_momentum"), (2, 3, "diagonal"),
                          (2, 3, "frequent_directions"), (3, 2, "qr_root"),
                          (2, 4, "eigh_basis_reuse")])
def test_checkpoint_restores_onto_another_device_count(before, after, name, data) -> None:  # noqa: ANN001
    config = CONFIGS[name]
    params, grads = data
    want, s_full = trajectory(config, params, grads, None)
    cut = 4
    first, s = trajectory(config, params, grads[:cut], before)
    like = jax.eval_shape(transformation(config, None)[0].init, place(params, None))
    if before is None:
        arrays = shampoo_jax.state_to_arrays(s)
    else:
        arrays = shampoo_jax.sharded_state_to_arrays(s, like, sharding_1d(before))
    # The saved arrays are those of the single-device state at the same step,
    # then the format and config entries.
    _, s_cut = trajectory(config, params, grads[:cut], None)
    for a, b in zip(arrays[:-2], jax.tree.leaves(s_cut), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert str(arrays[-1]) == str(shampoo_jax.config_array(config))
    if after is None:
        restored = shampoo_jax.state_from_arrays(arrays, like=like)
    else:
        restored = shampoo_jax.sharded_state_from_arrays(arrays, like, sharding_1d(after))
    resumed = {k: v for k, v in first[-1].items()}
    rest, _ = trajectory(config, resumed, grads[cut:], after, state=restored)
    assert_bitwise(first + rest, want)


def test_averaging_state_checkpoints_across_device_counts(data) -> None:  # noqa: ANN001
    """Eq. (20d)'s Z and S go through the sharded checkpoint: saved on 2 devices they are
    the single-device layout's arrays (Z per parameter, S a scalar), restored onto 2
    devices the run continues bit for bit, onto 3 within the float32 bound."""
    config = CONFIGS["schedule_free"]
    params, grads = data
    cut = 4
    want, _ = trajectory(config, params, grads, 2)
    first, s = trajectory(config, params, grads[:cut], 2)
    like = jax.eval_shape(transformation(config, None)[0].init, place(params, None))
    arrays = shampoo_jax.sharded_state_to_arrays(s, like, sharding_1d(2))
    z, power_sum = arrays[-3 - len(params):-3], arrays[-3]  # before format and config
    assert [a.shape for a in z] == [np.shape(params[k]) for k in sorted(params)]
    np.testing.assert_array_equal(z[0], np.asarray(s.averaged[sorted(params)[0]]))
    assert power_sum.shape == () and float(power_sum) == pytest.approx(4 * 0.1**2, rel=1e-6)
    for n in (2, 3):
        restored = shampoo_jax.sharded_state_from_arrays(arrays, like, sharding_1d(n))
        rest, _ = trajectory(config, dict(first[-1]), grads[cut:], n, state=restored)
        if n == 2:
            assert_bitwise(first + rest, want)
        else:
            assert_within_bound(config, params, grads, first + rest, want)


def test_sharding_config_and_state_errors_name_the_field(data) -> None:  # noqa: ANN001
    mesh = mesh_1d(2)
    with pytest.raises(ValueError, match=r"ShardingConfig.axis = 'data'.*allowed \('blocks',\)"):
        shampoo_jax.ShardingConfig(mesh, "data")
    with pytest.raises(ValueError, match="ShardingConfig.axis"):
        shampoo_jax.ShardingConfig(mesh, ())
    with pytest.raises(ValueError, match="ShardingConfig.mesh"):
        shampoo_jax.ShardingConfig("mesh", AXIS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharding = 'blocks' is invalid"):
        shampoo_jax.shampoo(BASE, sharding="blocks")  # type: ignore[arg-type]
    params, grads = data
    single, _ = transformation(BASE, None)
    opt, _ = transformation(BASE, 4)
    unpadded = single.init(place(params, 4))  # the one-device layout: 6 blocks, not 8
    with pytest.raises(ValueError, match=r"state.groups\[\d\] has \d blocks; .* 4 devices"):
        opt.update(place(grads[0], 4), unpadded, place(params, 4))


def test_two_axes_shard_blocks_over_the_product(data) -> None:  # noqa: ANN001
    params, grads = data
    want, _ = trajectory(BASE, params, grads[:4], None)
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:4]).reshape(2, 2), ("data", "model"))
    sharding = shampoo_jax.ShardingConfig(mesh, ("data", "model"))
    assert sharding.size == 4 and sharding.padded(6) == 8
    opt = shampoo_jax.shampoo(BASE, sharding=sharding)
    p = jax.device_put({k: jnp.asarray(v, jnp.float32) for k, v in params.items()},
                       sharding.replicated)
    s = opt.init(p)
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
        *opt.update(g, s, p)))
    got = []
    for g in grads[:4]:
        p, s = step(p, s, jax.device_put(
            {k: jnp.asarray(v, jnp.float32) for k, v in g.items()}, sharding.replicated))
        got.append({k: np.asarray(v) for k, v in p.items()})
    assert_bitwise(got, want)
    six = next(gs for gs in s.groups if gs.statistics_updates.shape[0] == 8)  # w: 6 -> 8
    assert {sh.data.shape[0] for sh in six.factors[0].addressable_shards} == {2}


def test_placement_fills_every_slot_once_and_balances_root_work() -> None:
    # bench.py's MLP: groups (512, 1024) x1, (1024, 1024) x2, (1024, 10) x1,
    # (1024,) x3, (10,) x1; root cost of a block = sum of n^3 over its factors.
    sizes = (1, 2, 1, 3, 1)
    costs = (512.0**3 + 1024.0**3, 2 * 1024.0**3, 1024.0**3 + 10.0**3, 1024.0**3, 10.0**3)
    busiest = {}
    for n in (1, 2, 3, 4, 5):
        slots = placement(sizes, costs, n)
        load = [0.0] * n
        for nb, cost, sl in zip(sizes, costs, slots, strict=True):
            per = -(-nb // n)
            assert sorted(sl) == sorted(set(sl)) and all(0 <= x < per * n for x in sl)
            for x in sl:
                load[x // per] += cost
        total = sum(nb * c for nb, c in zip(sizes, costs, strict=True))
        assert sum(load) == total
        # List scheduling, largest first: within one block of the even share.
        assert max(load) <= total / n + max(costs), (n, load)
        busiest[n] = max(load) / total
    # Four devices: 3.2e9 of 9.8e9 on the busiest, near the 0.25 of a perfect
    # split (blocks are indivisible); real blocks first in every group would
    # put 5.5e9 (0.56) on device 0.
    assert busiest[4] < 0.34 and busiest[1] == 1.0


def test_a_parameter_without_factors_beside_a_delayed_start_compiles_sharded() -> None:
    """A 0-d parameter kept unsqueezed and without a scalar factor has no factors: its
    group's failure count in the root step must still vary over the mesh axis as the
    skipped branch's does (a conformance draw found lax.cond refusing the mismatch)."""
    config = ss.ShampooConfig(
        learning_rate=0.01, epsilon=ss.EpsilonConfig(value=1e-3),
        blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None,
                                   squeeze=False, scalar_factor=False),
        schedule=ss.ScheduleConfig(start_preconditioning_step=2),
    )
    rng = np.random.default_rng(0)
    params = {"p0": rng.standard_normal(()), "p1": rng.standard_normal((1,))}
    grads = [{k: rng.standard_normal(v.shape) for k, v in params.items()} for _ in range(3)]
    want, _ = trajectory(config, params, grads, None)
    got, _ = trajectory(config, params, grads, 2)
    assert_bitwise(got, want)
