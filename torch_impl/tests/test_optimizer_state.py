"""The optimizer as a torch.optim.Optimizer: groups, lr, checkpoints, failure policy.

docs/reliability.md: resuming continues bit-identically; a mismatched state
fails clearly; a non-finite gradient never corrupts the state (raise naming
the parameter, or skip the block and count it); failed roots keep the
previous root and are counted, and too many in a row raise.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from shampoo_reference import run as reference_run
from shampoo_spec import (
    BlockingConfig,
    CoupledNewtonConfig,
    DiagonalPreconditionerConfig,
    EigenvalueCorrectionConfig,
    EighConfig,
    EpsilonConfig,
    FailureConfig,
    FrequentDirectionsConfig,
    GradientFilterConfig,
    GraftingConfig,
    IterateAveragingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
    StatisticsConfig,
    WeightDecayConfig,
)
from shampoo_torch import NonFiniteGradientError, RootFailureError, Shampoo

SHAPES = [(6, 9), (9,), (2, 3, 4), (), (1, 5)]

RICH = ShampooConfig(
    learning_rate=0.02,
    statistics=StatisticsConfig(beta2=0.95, bias_correction=True),
    epsilon=EpsilonConfig(value=1e-5),
    grafting=GraftingConfig(type="adam", beta2=0.99, bias_correction=True),
    gradient_filter=GradientFilterConfig(beta1=0.9, bias_correction=True),
    momentum=MomentumConfig(momentum=0.5, nesterov=True, buffers="separate"),
    blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    schedule=ScheduleConfig(precondition_frequency=3, start_preconditioning_step=2),
)
RESUME_CASES = {
    "rich_float32": (RICH, torch.float32),
    "eigenvalue_correction_float64": (
        dataclasses.replace(RICH, eigenvalue_correction=EigenvalueCorrectionConfig(),
                            factor_dtype="float64",
                            momentum=MomentumConfig(momentum=0.9)),
        torch.float64,
    ),
    "newton_skip_block": (
        dataclasses.replace(RICH, root_inverse=CoupledNewtonConfig(),
                            failure=FailureConfig(nonfinite_gradient="skip_block")),
        torch.float32,
    ),
    # Eq. (17a): float64 factors, eigenbases in bfloat16, D in float32 (resume bit for bit).
    "eigenvalue_correction_stored_dtypes": (
        dataclasses.replace(RICH, factor_dtype="float64", momentum=MomentumConfig(momentum=0.9),
                            eigenvalue_correction=EigenvalueCorrectionConfig(
                                eigenvectors_dtype="bfloat16",
                                corrected_eigenvalues_dtype="float32")),
        torch.float64,
    ),
    # Eq. (10f): QR roots from the stored eigenbases (saved, so the resumed run's first
    # root step starts from the same basis), blocks skipped too.
    "qr_root_skip_block_float64": (
        dataclasses.replace(RICH, factor_dtype="float64",
                            root_inverse=EighConfig(eigenbasis_method="qr", qr_max_iterations=2),
                            failure=FailureConfig(nonfinite_gradient="skip_block")),
        torch.float64,
    ),
    # Eq. (10h): eigh roots keeping their stored eigenbases while they fit (saved, so the
    # resumed run judges its first root step against the same basis), blocks skipped too.
    "eigh_basis_reuse_skip_block_float64": (
        dataclasses.replace(RICH, factor_dtype="float64",
                            root_inverse=EighConfig(basis_reuse_tolerance=0.3),
                            failure=FailureConfig(nonfinite_gradient="skip_block")),
        torch.float64,
    ),
    # Eq. (11a): float64 factors, roots stored in bfloat16.
    "bfloat16_roots_float64": (
        dataclasses.replace(RICH, factor_dtype="float64", inverse_root_dtype="bfloat16"),
        torch.float64,
    ),
    # Eq. (11b): factors stored in float16 (float64 work), roots in float32.
    "float16_factors_float64": (
        dataclasses.replace(RICH, factor_dtype="float64", factor_storage_dtype="float16",
                            inverse_root_dtype="float32"),
        torch.float64,
    ),
    # Eq. (20c): int16 factors and roots (read back in float32), float32 scales, blocks
    # skipped too.
    "int16_statistics_skip_block": (
        dataclasses.replace(RICH, root_inverse=CoupledNewtonConfig(),
                            statistics=StatisticsConfig(beta2=0.95, bias_correction=True,
                                                        storage="int16_columnwise_diagonal"),
                            failure=FailureConfig(nonfinite_gradient="skip_block")),
        torch.float32,
    ),
    # Eq. (20b): int8 momentum (separate buffers) with float32 scales, blocks skipped too.
    "int8_momentum_skip_block": (
        dataclasses.replace(RICH, momentum=dataclasses.replace(
            RICH.momentum, storage="int8_columnwise"),
            failure=FailureConfig(nonfinite_gradient="skip_block")),
        torch.float32,
    ),
    # Eq. (20d): Schedule-Free averaging (Z and the sum of lr^p saved), decoupled decay.
    "schedule_free_float64": (
        dataclasses.replace(RICH, momentum=MomentumConfig(), factor_dtype="float64",
                            weight_decay=WeightDecayConfig(value=0.01),
                            averaging=IterateAveragingConfig(type="schedule_free")),
        torch.float64,
    ),
    # Eqs. (6c), (10d): the factors of 4 sketched at rank 1 (U, lambda, rho saved) and
    # the gradient sum S of average_gradients, saved after step 7, mid-period (statistics
    # and roots every 3rd step, resets at 1, 6, 11), blocks skipped too.
    "frequent_directions_average_skip_block": (
        dataclasses.replace(RICH, statistics=StatisticsConfig(beta2=0.95),
                            frequent_directions=FrequentDirectionsConfig(
                                rank=1, average_gradients=True, reset_every=5),
                            schedule=ScheduleConfig(precondition_frequency=3,
                                                    statistics_frequency=3,
                                                    start_preconditioning_step=2),
                            failure=FailureConfig(nonfinite_gradient="skip_block")),
        torch.float32,
    ),
    # Eqs. (6c), (10e): tearfree's Sketchy, every factor sketched at min(n, 2) (U, lambda,
    # rho saved), sketches every 3rd step, saved after step 7 (mid-period), blocks
    # skipped too.
    "frequent_directions_tearfree_skip_block": (
        dataclasses.replace(RICH, statistics=StatisticsConfig(beta2=0.95),
                            epsilon=EpsilonConfig(value=1e-3, scale="relative"),
                            frequent_directions=FrequentDirectionsConfig(rank=2,
                                                                         rule="tearfree"),
                            schedule=ScheduleConfig(precondition_frequency=3,
                                                    statistics_frequency=3,
                                                    start_preconditioning_step=2),
                            failure=FailureConfig(nonfinite_gradient="skip_block")),
        torch.float32,
    ),
    # Eq. (16b): an Adam diagonal preconditioner (its V_D saved), blocks skipped too.
    "diagonal_adam_skip_block": (
        dataclasses.replace(RICH, diagonal=DiagonalPreconditionerConfig(
            type="adam", beta2=0.99, bias_correction=True),
            failure=FailureConfig(nonfinite_gradient="skip_block")),
        torch.float32,
    ),
}


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def make_grads(steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]


def run_steps(
    opt: Shampoo, params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]]
) -> None:
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.to(p.dtype)
        opt.step()


def roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_trees_equal(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for k in a:
            assert_trees_equal(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_trees_equal(x, y)
    else:
        assert a == b


# ----------------------------------------------------------------- resume
@pytest.mark.parametrize("name", sorted(RESUME_CASES))
def test_resume_is_bit_identical(name: str) -> None:
    config, dtype = RESUME_CASES[name]
    grads = make_grads(14)
    if config.failure.nonfinite_gradient == "skip_block":
        grads[2][0][0, 0] = float("nan")
        grads[9][1][3] = float("inf")
    straight = make_params(dtype)
    opt = Shampoo(straight, config)
    run_steps(opt, straight, grads)

    first = make_params(dtype)
    opt1 = Shampoo(first, config)
    run_steps(opt1, first, grads[:7])
    saved = roundtrip(opt1.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = Shampoo(resumed, config)
    opt2.load_state_dict(saved)
    run_steps(opt2, resumed, grads[7:])

    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
    assert_trees_equal(opt.state_dict(), opt2.state_dict())
    assert opt.metrics == opt2.metrics
    fd = config.frequent_directions
    if fd is not None:  # the saved state held a sketch (and a sum when averaged)
        blocks = [b for entry in saved["state"].values() for b in entry["blocks"].values()]
        assert any(bool(s["lam"].any()) for b in blocks for s in b.get("sketches", {}).values())
        if fd.average_gradients:
            assert any(bool(entry["gradient_sum"].any()) for entry in saved["state"].values())


def test_resume_keeps_the_first_learning_rate_of_a_growing_root_period() -> None:
    """Eq. (8b)'s lr_1 is a param-group entry: saved, restored and checked on load."""
    config = ShampooConfig(
        learning_rate=0.1, epsilon=EpsilonConfig(value=1e-3),
        schedule=ScheduleConfig(precondition_frequency=4, precondition_frequency_growth=21,
                                period_anchor="start", roots_before_start=True),
    )
    grads = make_grads(14)
    rates = [0.1 * (1.0 - c / 14.0) for c in range(14)]

    def run(opt: Shampoo, ps: list[torch.nn.Parameter], steps: range) -> None:
        for k in steps:
            opt.param_groups[0]["lr"] = rates[k]
            run_steps(opt, ps, grads[k:k + 1])

    straight = make_params(torch.float64)
    opt = Shampoo(straight, config)
    run(opt, straight, range(14))
    first = make_params(torch.float64)
    opt1 = Shampoo(first, config)
    run(opt1, first, range(7))
    saved = roundtrip(opt1.state_dict())
    assert saved["param_groups"][0]["first_step_lr"] == 0.1
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = Shampoo(resumed, config)
    opt2.load_state_dict(saved)
    run(opt2, resumed, range(7, 14))
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
    # Without it the resumed run would take lr_8 as lr_1 (ratio 1): other root steps.
    lost = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt3 = Shampoo(lost, config)
    del saved["param_groups"][0]["first_step_lr"]
    opt3.load_state_dict(saved)
    run(opt3, lost, range(7, 14))
    assert any(not torch.equal(a, b) for a, b in zip(straight, lost, strict=True))
    bad = roundtrip(opt1.state_dict())
    bad["param_groups"][0]["first_step_lr"] = float("nan")
    with pytest.raises(ValueError, match="first_step_lr"):
        Shampoo(make_params(torch.float64), config).load_state_dict(bad)


def test_averaging_train_eval_and_checkpoint_of_the_mode() -> None:
    """Eq. (20d): eval() and train() are inverse maps, step() is refused in eval mode
    (changing nothing), and a checkpoint taken in eval mode loads in eval mode."""
    config = dataclasses.replace(RICH, momentum=MomentumConfig(),
                                 averaging=IterateAveragingConfig(train_interp=0.75))
    params = make_params(torch.float64)
    opt = Shampoo(params, config)
    run_steps(opt, params, make_grads(5))
    trained = [p.detach().clone() for p in params]
    opt.eval()
    averaged = [p.detach().clone() for p in params]
    assert any(not torch.equal(a, b) for a, b in zip(trained, averaged, strict=True))
    before = roundtrip(opt.state_dict())
    with pytest.raises(RuntimeError, match="eval mode"):
        run_steps(opt, params, make_grads(1, seed=9))
    assert_trees_equal(before, opt.state_dict())  # the refused step changed nothing
    opt.eval()  # already in eval mode: no-op
    assert all(torch.equal(p.detach(), a) for p, a in zip(params, averaged, strict=True))
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = Shampoo(resumed, config)
    opt2.load_state_dict(before)
    assert opt2.param_groups[0]["averaging_mode"] == "eval"
    for o, ps in ((opt, params), (opt2, resumed)):
        o.train()
        for p, w in zip(ps, trained, strict=True):
            torch.testing.assert_close(p.detach(), w, rtol=1e-14, atol=1e-14)
    bad = roundtrip(opt.state_dict())
    bad["param_groups"][0]["averaging_mode"] = "test"
    with pytest.raises(ValueError, match="averaging_mode = 'test'"):
        opt2.load_state_dict(bad)


def test_state_dict_is_a_snapshot_and_plain() -> None:
    params = make_params()
    opt = Shampoo(params, RICH)
    run_steps(opt, params, make_grads(3))
    sd = opt.state_dict()
    before = roundtrip(sd)
    run_steps(opt, params, make_grads(2, seed=5))
    assert_trees_equal(sd, before)  # later steps do not change a saved state
    assert isinstance(sd["param_groups"][0]["config"], dict)
    assert ShampooConfig.from_dict(sd["param_groups"][0]["config"]) == RICH


# ---------------------------------------------------------- load mismatch
def _saved(config: ShampooConfig = RICH) -> dict:
    params = make_params()
    opt = Shampoo(params, config)
    run_steps(opt, params, make_grads(2))
    return roundtrip(opt.state_dict())


def test_load_rejects_a_different_config() -> None:
    other = dataclasses.replace(RICH, grafting=GraftingConfig(type="adagrad"))
    params = make_params()
    opt = Shampoo(params, other)
    with pytest.raises(ValueError, match=r"config.*grafting"):
        opt.load_state_dict(_saved())


def _root_dtypes(sd: dict) -> set[torch.dtype]:
    return {x.dtype for entry in sd["state"].values()
            for block in (entry["blocks"].values() if isinstance(entry["blocks"], dict)
                          else entry["blocks"])
            for x in block["inverse_roots"].values()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_checkpoints_carry_the_inverse_root_dtype(dtype: str) -> None:
    """Eq. (11a): roots are saved in ``inverse_root_dtype`` (both formats), factors in
    ``factor_dtype``, and they load back bit for bit."""
    config = dataclasses.replace(RICH, factor_dtype="float64",
                                 inverse_root_dtype=dtype)  # type: ignore[arg-type]
    params = make_params(torch.float64)
    opt = Shampoo(params, config)
    run_steps(opt, params, make_grads(4))
    want = getattr(torch, dtype)
    for saved in (roundtrip(opt.state_dict()), roundtrip(opt.distributed_state_dict())):
        assert _root_dtypes(saved) == {want}
        factors = {f.dtype for entry in saved["state"].values()
                   for block in (entry["blocks"].values() if isinstance(entry["blocks"], dict)
                                 else entry["blocks"])
                   for f in block["factors"].values()}
        assert factors == {torch.float64}
    fresh = Shampoo(make_params(torch.float64), config)
    fresh.load_state_dict(roundtrip(opt.state_dict()))
    assert_trees_equal(fresh.state_dict(), opt.state_dict())
    assert {x.dtype for v in fresh.blocks() for x in (v.inverse_roots or ()) if x is not None} \
        == {want}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_checkpoints_carry_the_factor_storage_dtype(dtype: str) -> None:
    """Eq. (11b): factors are saved in ``factor_storage_dtype`` (both formats) and load
    back bit for bit; a factor saved in another dtype is refused, not rounded."""
    config = dataclasses.replace(RICH, factor_dtype="float64",
                                 factor_storage_dtype=dtype)  # type: ignore[arg-type]
    params = make_params(torch.float64)
    opt = Shampoo(params, config)
    run_steps(opt, params, make_grads(4))
    want = getattr(torch, dtype)
    for saved in (roundtrip(opt.state_dict()), roundtrip(opt.distributed_state_dict())):
        factors = {f.dtype for block in _blocks(saved) for f in block["factors"].values()}
        assert factors == {want}
        assert _root_dtypes(saved) == {torch.float64}
    fresh = Shampoo(make_params(torch.float64), config)
    fresh.load_state_dict(roundtrip(opt.state_dict()))
    assert_trees_equal(fresh.state_dict(), opt.state_dict())
    widened = roundtrip(opt.state_dict())
    for block in _blocks(widened):
        block["factors"] = {k: f.double() for k, f in block["factors"].items()}
    with pytest.raises(ValueError, match="factor_storage_dtype, eq. 11b"):
        Shampoo(make_params(torch.float64), config).load_state_dict(widened)


def _blocks(sd: dict) -> list[dict]:
    return [block for entry in sd["state"].values()
            for block in (entry["blocks"].values() if isinstance(entry["blocks"], dict)
                          else entry["blocks"]) if block]


@pytest.mark.parametrize(("q", "s"), [("bfloat16", "float16"), ("float32", "bfloat16")])
def test_checkpoints_carry_the_eigenvalue_correction_dtypes(q: str, s: str) -> None:
    """Eq. (17a): eigenbases saved in ``eigenvectors_dtype``, D in
    ``corrected_eigenvalues_dtype`` (both formats); they load back bit for bit; a D
    saved in another dtype is refused, not re-rounded, and changes nothing."""
    ec = EigenvalueCorrectionConfig(epsilon=1e-4, eigenvectors_dtype=q,  # type: ignore[arg-type]
                                    corrected_eigenvalues_dtype=s)  # type: ignore[arg-type]
    config = dataclasses.replace(RICH, factor_dtype="float64", eigenvalue_correction=ec,
                                 momentum=MomentumConfig(momentum=0.9))
    params = make_params(torch.float64)
    opt = Shampoo(params, config)
    run_steps(opt, params, make_grads(4))
    for saved in (roundtrip(opt.state_dict()), roundtrip(opt.distributed_state_dict())):
        assert _root_dtypes(saved) == {getattr(torch, q)}
        assert {b["corrected"].dtype for b in _blocks(saved)} == {getattr(torch, s)}
    fresh = Shampoo(make_params(torch.float64), config)
    fresh.load_state_dict(roundtrip(opt.state_dict()))
    assert_trees_equal(fresh.state_dict(), opt.state_dict())
    widened = roundtrip(opt.state_dict())
    for block in _blocks(widened):
        block["corrected"] = block["corrected"].double()
    other = Shampoo(make_params(torch.float64), config)
    before = roundtrip(other.state_dict())
    with pytest.raises(ValueError, match=rf"corrected.*dtype torch\.float64 does not match "
                                         rf"torch\.{s}"):
        other.load_state_dict(widened)
    assert_trees_equal(other.state_dict(), before)


def test_load_refuses_inverse_roots_in_another_dtype_and_changes_nothing() -> None:
    """A root saved in float64 where the config stores bfloat16 is refused, not re-rounded."""
    config = dataclasses.replace(RICH, factor_dtype="float64", inverse_root_dtype="bfloat16")
    params = make_params(torch.float64)
    opt = Shampoo(params, config)
    run_steps(opt, params, make_grads(4))
    saved = roundtrip(opt.state_dict())
    for entry in saved["state"].values():
        for block in entry["blocks"].values():
            block["inverse_roots"] = {k: x.double() for k, x in block["inverse_roots"].items()}
    fresh = Shampoo(make_params(torch.float64), config)
    before = roundtrip(fresh.state_dict())
    with pytest.raises(ValueError, match=r"inverse_roots.*dtype torch\.float64 does not match "
                                         r"torch\.bfloat16"):
        fresh.load_state_dict(saved)
    assert_trees_equal(fresh.state_dict(), before)
    # A different inverse_root_dtype in the config is named as such.
    other = Shampoo(make_params(torch.float64),
                    dataclasses.replace(config, inverse_root_dtype="float32"))
    with pytest.raises(ValueError, match="inverse_root_dtype: 'bfloat16' -> 'float32'"):
        other.load_state_dict(roundtrip(opt.state_dict()))


INT8 = dataclasses.replace(RICH, factor_dtype="float64", momentum=dataclasses.replace(
    RICH.momentum, storage="int8_columnwise", scale_dtype="float64"))


def test_checkpoints_keep_int8_momentum_and_refuse_other_dtypes() -> None:
    """Eq. (20b): int8 buffers (the parameter's own shape) and their scales are saved as
    they are (both formats) and load back bit for bit; a float buffer in their place, a
    scale in another dtype, or a state saved under float storage is refused, changing nothing."""
    params = make_params(torch.float64)
    opt = Shampoo(params, INT8)
    run_steps(opt, params, make_grads(4))
    for saved in (roundtrip(opt.state_dict()), roundtrip(opt.distributed_state_dict())):
        entries = list(saved["state"].values())
        for entry, shape in zip(entries, SHAPES, strict=True):
            for key in ("momentum", "graft_momentum"):
                if len(shape) >= 2:
                    assert entry[key].dtype == torch.int8 and tuple(entry[key].shape) == shape
                    assert entry[key + "_scale"].dtype == torch.float64
                    assert tuple(entry[key + "_scale"].shape) == shape[1:]
                    assert int(entry[key].abs().max()) == 127
                else:
                    assert entry[key].dtype == torch.float64 and key + "_scale" not in entry
    fresh = Shampoo(make_params(torch.float64), INT8)
    fresh.load_state_dict(roundtrip(opt.state_dict()))
    assert_trees_equal(fresh.state_dict(), opt.state_dict())
    before = roundtrip(fresh.state_dict())
    bad = roundtrip(opt.state_dict())
    bad["state"][0]["momentum"] = bad["state"][0]["momentum"].double()
    with pytest.raises(ValueError, match=r"momentum.*dtype torch\.float64 does not match "
                                         r"torch\.int8"):
        fresh.load_state_dict(bad)
    bad = roundtrip(opt.state_dict())
    bad["state"][0]["momentum_scale"] = bad["state"][0]["momentum_scale"].float()
    with pytest.raises(ValueError, match=r"momentum_scale.*dtype torch\.float32 does not match"):
        fresh.load_state_dict(bad)
    bad = roundtrip(opt.state_dict())
    bad["state"][0]["momentum"][0, 0] = -128
    with pytest.raises(ValueError, match="-128"):
        fresh.load_state_dict(bad)
    assert_trees_equal(fresh.state_dict(), before)
    plain = Shampoo(make_params(torch.float64), dataclasses.replace(INT8, momentum=RICH.momentum))
    with pytest.raises(ValueError, match="momentum.storage: 'int8_columnwise' -> 'float'"):
        plain.load_state_dict(roundtrip(opt.state_dict()))


def test_checkpoints_refuse_another_factor_storage() -> None:
    """Eq. (20c): a state saved under int16 factor storage is refused under float storage
    (and the reverse), naming the field."""
    int16 = dataclasses.replace(RICH, factor_dtype="float64", root_inverse=CoupledNewtonConfig(),
                                statistics=StatisticsConfig(storage="int16_columnwise_diagonal"))
    params = make_params(torch.float64)
    opt = Shampoo(params, int16)
    run_steps(opt, params, make_grads(4))
    plain = Shampoo(make_params(torch.float64), dataclasses.replace(
        int16, statistics=StatisticsConfig()))
    with pytest.raises(ValueError, match="statistics.storage: 'int16_columnwise_diagonal' -> "
                                         "'float'"):
        plain.load_state_dict(roundtrip(opt.state_dict()))
    run_steps(plain, params, make_grads(2))
    with pytest.raises(ValueError, match="statistics.storage: 'float' -> "):
        opt.load_state_dict(roundtrip(plain.state_dict()))


def test_load_rejects_other_shapes_and_changes_nothing() -> None:
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(6, 9), (9,), (2, 3, 5), (), (1, 5)]]
    opt = Shampoo(params, RICH)
    before = opt.state_dict()
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(_saved())
    assert_trees_equal(before, opt.state_dict())


def test_load_rejects_other_group_structure() -> None:
    params = make_params()
    opt = Shampoo([{"params": params[:2]}, {"params": params[2:]}], RICH)
    with pytest.raises(ValueError, match="groups"):
        opt.load_state_dict(_saved())
    opt = Shampoo(params[:3], RICH)
    with pytest.raises(ValueError, match="parameters"):
        opt.load_state_dict(_saved())


# ------------------------------------------------------------ eq. (3) policy
def test_nonfinite_gradient_raise_names_parameter_and_changes_nothing() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = Shampoo(model.named_parameters(), RICH)
    x = torch.randn(5, 4)
    model(x).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state = opt.state_dict()
    model[1].weight.grad[0, 1] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"'1\.weight'"):
        opt.step()
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), q)
    assert_trees_equal(state, opt.state_dict())


def test_skip_block_leaves_the_block_and_counts_it() -> None:
    config = dataclasses.replace(RICH, failure=FailureConfig(nonfinite_gradient="skip_block"))
    params = make_params()
    opt = Shampoo(params, config)
    run_steps(opt, params, make_grads(2))
    w = params[0].detach().clone()  # (6, 9), blocks of 4: rows 0-3 / 4-5, cols 0-3 / 4-7 / 8
    grads = make_grads(1, seed=3)
    grads[0][0][5, 8] = float("inf")
    run_steps(opt, params, grads)
    assert torch.equal(params[0].detach()[4:, 8:], w[4:, 8:])
    assert not torch.equal(params[0].detach()[:4, :4], w[:4, :4])
    assert torch.isfinite(params[0]).all()
    assert opt.metrics == {"root_failures": 0, "skipped_blocks": 1, "withheld_updates": 0}


# ----------------------------------------------------------- eq. (13) roots
def test_failed_roots_keep_previous_are_counted_and_limit_raises() -> None:
    # The error after convergence (<= 1e-6) is never below this threshold: every root fails.
    newton = CoupledNewtonConfig(failure_threshold=1e-300)
    config = ShampooConfig(
        root_inverse=newton, epsilon=EpsilonConfig(value=1e-3),
        blocking=BlockingConfig(merge_dims_up_to=None),
        schedule=ScheduleConfig(precondition_frequency=2),
        failure=FailureConfig(max_consecutive_root_failures=3),
        factor_dtype="float64",
    )
    p = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    opt = Shampoo([p], config)
    grads = [[torch.randn(3, 4, dtype=torch.float64)] for _ in range(6)]
    w0 = p.detach().clone()
    run_steps(opt, [p], [[g[0]] for g in grads[:5]])  # root steps 1, 2, 4: 3 failures x 2 factors
    assert opt.metrics["root_failures"] == 6
    # Identity roots kept: the update is plain SGD on the gradients.
    expected = w0 - 0.01 * sum(g[0] for g in grads[:5])
    torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(RootFailureError, match="in a row"):
        run_steps(opt, [p], [grads[5]])  # root step 6: the fourth consecutive failure > 3


def test_nonfinite_factor_fails_its_root_only() -> None:
    # Eq. (3) refuses gradients whose squares could overflow the factors; a finite
    # float32 factor can still give a non-finite root input: with weight 1 and bias
    # correction, L / (1 - 0.999) overflows float32.
    config = ShampooConfig(epsilon=EpsilonConfig(value=1e-3),
                           statistics=StatisticsConfig(beta2=0.999, ema_weight="one",
                                                       bias_correction=True),
                           blocking=BlockingConfig(merge_dims_up_to=None))
    p = torch.nn.Parameter(torch.zeros(2, 3))
    q = torch.nn.Parameter(torch.zeros(2, 3))
    opt = Shampoo([p, q], config)
    p.grad = torch.full((2, 3), 2e18)  # 6 g^2 = 2.4e37 < 2^127: accepted by eq. (3)
    q.grad = torch.ones(2, 3)
    opt.step()
    assert opt.metrics["skipped_blocks"] == 0
    factors = [f for v in opt.blocks() for f in v.factors or () if f is not None]
    assert all(torch.isfinite(f).all() for f in factors)
    assert opt.metrics["root_failures"] == 2  # both factors of p; q's roots are fine
    assert torch.isfinite(p).all() and torch.isfinite(q).all()
    assert not torch.equal(q.detach(), torch.zeros(2, 3))


# ----------------------------------------------------- groups, lr, grads
def test_learning_rate_precedence_and_scheduler() -> None:
    a, b, c = (torch.nn.Parameter(torch.randn(3)) for _ in range(3))
    cfg2 = ShampooConfig(learning_rate=0.3)
    opt = Shampoo([{"params": [a]}, {"params": [b], "config": cfg2},
                   {"params": [c], "lr": 0.7}], ShampooConfig(learning_rate=0.1))
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.3, 0.7]
    opt = Shampoo([{"params": [a]}, {"params": [b], "config": cfg2}], lr=0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.5]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0)
    assert opt.param_groups[0]["lr"] == 0.0
    w = a.detach().clone()
    a.grad = torch.ones(3)
    opt.step()
    sched.step()
    assert torch.equal(a.detach(), w)  # lr 0 from the scheduler: no move
    with pytest.raises(ValueError, match="lr"):
        Shampoo([a], lr=-1.0)


def test_each_group_runs_its_own_config_like_the_reference() -> None:
    cfg_a = ShampooConfig(learning_rate=0.05, epsilon=EpsilonConfig(value=1e-4),
                          factor_dtype="float64")
    cfg_b = dataclasses.replace(cfg_a, grafting=GraftingConfig(type="adagrad"),
                                momentum=MomentumConfig(momentum=0.9))
    rng = np.random.default_rng(0)
    w = {"a": rng.standard_normal((4, 5)), "b": rng.standard_normal((5,))}
    grads = [{k: rng.standard_normal(v.shape) for k, v in w.items()} for _ in range(6)]
    pa, pb = (torch.nn.Parameter(torch.tensor(w[k])) for k in "ab")
    opt = Shampoo([{"params": [pa], "config": cfg_a}, {"params": [pb], "config": cfg_b}])
    for g in grads:
        pa.grad, pb.grad = torch.tensor(g["a"]), torch.tensor(g["b"])
        opt.step()
    ref_a = reference_run(cfg_a, {"a": w["a"]}, [{"a": g["a"]} for g in grads])[-1]["a"]
    ref_b = reference_run(cfg_b, {"b": w["b"]}, [{"b": g["b"]} for g in grads])[-1]["b"]
    np.testing.assert_allclose(pa.detach().numpy(), ref_a, rtol=1e-10)
    np.testing.assert_allclose(pb.detach().numpy(), ref_b, rtol=1e-10)


def test_params_without_grad_keep_their_state_and_counter() -> None:
    """A parameter without .grad is untouched; later it continues on its own step count."""
    config = dataclasses.replace(RICH, factor_dtype="float64")
    grads = make_grads(6)
    together = make_params(torch.float64)
    opt = Shampoo(together, config)
    alone = make_params(torch.float64)
    opt_alone = Shampoo([alone[0]], config)
    for t, step in enumerate(grads):
        for i, (p, g) in enumerate(zip(together, step, strict=True)):
            p.grad = None if (i == 0 and t in (1, 2)) else g.double()
        if t in (1, 2):
            state = {k: v.clone() if isinstance(v, torch.Tensor) else v
                     for k, v in opt.state[together[0]].items()}
            w = together[0].detach().clone()
        opt.step()
        if t in (1, 2):
            assert torch.equal(together[0].detach(), w)
            assert_trees_equal(state, dict(opt.state[together[0]]))
        else:
            alone[0].grad = step[0].double()
            opt_alone.step()
    # Block state is per block, and the norm scope is the block: the parameter that
    # missed steps 2-3 equals a run that never saw them.
    torch.testing.assert_close(together[0].detach(), alone[0].detach(), rtol=1e-12, atol=0)
    assert opt.state[together[0]]["step"] == 4 and opt.state[together[1]]["step"] == 6


def test_bf16_params_keep_float32_state_and_track_float32_run() -> None:
    config = dataclasses.replace(RICH, epsilon=EpsilonConfig(value=1e-3))
    grads = make_grads(8)
    low = make_params(torch.bfloat16)
    high = [torch.nn.Parameter(p.detach().float()) for p in low]
    opt_low, opt_high = Shampoo(low, config), Shampoo(high, config)
    run_steps(opt_low, low, grads)
    run_steps(opt_high, high, grads)
    for p, q in zip(low, high, strict=True):
        assert p.dtype == torch.bfloat16
        st = opt_low.state[p]
        assert st["graft"].dtype == torch.float32 and st["momentum"].dtype == torch.float32
        # bf16 keeps 8 bits: each of the 8 updates rounds the parameter by <= 2^-8 relative.
        err = torch.linalg.vector_norm(p.detach().float() - q.detach())
        assert err <= 8 * 2**-8 * torch.linalg.vector_norm(q.detach()) + 1e-6
    for view in opt_low.blocks():
        assert view.factors is not None
        assert all(f is None or f.dtype == torch.float32 for f in view.factors)


def test_zero_dim_and_size_one_params() -> None:
    params = [torch.nn.Parameter(torch.tensor(1.5)), torch.nn.Parameter(torch.ones(1, 1, 1))]
    opt = Shampoo(params, ShampooConfig(learning_rate=0.1, factor_dtype="float64"))
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    opt.step()
    # A 1x1 factor L = 4, root 2: P = 4^(-1/2) * 2 = 1 (epsilon 1e-12 is negligible).
    # (float32 parameters: the result is 1.4 and 0.9 to float32 rounding.)
    assert params[0].shape == () and abs(float(params[0].detach()) - 1.4) < 1e-6
    assert params[1].shape == (1, 1, 1) and abs(float(params[1].detach().sum()) - 0.9) < 1e-6


def test_metrics_are_lazy_device_counters() -> None:
    params = make_params()
    opt = Shampoo(params, RICH)
    assert opt.metrics == {"root_failures": 0, "skipped_blocks": 0, "withheld_updates": 0}
    run_steps(opt, params, make_grads(2))
    counters = next(iter(opt._counters.by_device.values()))
    assert all(isinstance(v, torch.Tensor) for v in counters.values())
    assert opt.metrics == {"root_failures": 0, "skipped_blocks": 0, "withheld_updates": 0}
