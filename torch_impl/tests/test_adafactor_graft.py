"""Eq. (14e), the Adafactor graft, in torch: the reference's steps and moments.

- The moments R, C (or V) of each whole parameter, in its own shape, are the
  reference's after every step (float64: 1e-12 relative; the same means and
  decays, summed in another order), for factored 2-d and 3-d parameters, tied
  largest dims, vectors, small matrices (second dim below ``factor_min_dim``),
  a scalar and size-1 dims.
- The parameters equal the reference's at 1e-9 (as test_reference_equality.py)
  with preconditioning from step 3, so the raw graft step (steps 1-2) and the
  Shampoo step rescaled to the graft's norm (eq. 18, per block and per
  parameter) are both checked, with and without eq. (14d)'s clip and the
  parameter scale; float32 within the bound of spec section 5.
- Eq. (3): a refused block keeps the moments of its whole parameter, and
  the moments enter the bound m of every block of the parameter.
- Checkpoints: the moments are saved and restored (resume bit for bit).
- Distributed (gloo, world size 2): bit for bit the single process, and
  resumable across world sizes (``distributed_scenarios.adafactor``).
"""

from __future__ import annotations

import dataclasses
import io
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shampoo_conformance.adapters.torch import run as torch_run
from shampoo_reference import ReferenceShampoo
from shampoo_reference import run as reference_run
from shampoo_reference.grafting import FactoredMoments
from shampoo_spec import (
    STATE_LIMIT,
    BlockingConfig,
    EpsilonConfig,
    FailureConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    ScheduleConfig,
    ShampooConfig,
)
from shampoo_torch import Shampoo
from shampoo_torch.grafting import (
    ADAFACTOR_COL,
    ADAFACTOR_FULL,
    ADAFACTOR_KEYS,
    ADAFACTOR_ROW,
)

from .helpers import max_relative_error, spawn_ok, stream
from .test_reference_equality import _float32_rtol

#: factor_min_dim = 4: "w", "t", "q" (a tie: d0 is the later dim), "o" are factored;
#: "v", "s" (rank < 2) and "n" (its second dim 2 < 4) keep the full V.
SHAPES = {"w": (7, 10), "t": (3, 8, 5), "q": (6, 6), "o": (4, 1, 5), "v": (7,), "n": (2, 9),
          "s": ()}
FACTORED = {"w", "t", "q", "o"}
STEPS = 8
SCENARIOS = str(Path(__file__).with_name("distributed_scenarios.py"))


def adafactor(**changes: Any) -> GraftingConfig:
    kw: dict[str, Any] = {"type": "adafactor", "epsilon_placement": "inside_sqrt",
                          "epsilon": 1e-8, "decay_exponent": 0.8, "factor_min_dim": 4,
                          **changes}
    return GraftingConfig(**kw)


BASE = ShampooConfig(
    learning_rate=0.05,
    epsilon=EpsilonConfig(value=1e-6),
    blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
    grafting=adafactor(),
    momentum=MomentumConfig(momentum=0.9),
    schedule=ScheduleConfig(start_preconditioning_step=3),
    factor_dtype="float64",  # as the conformance adapter's float64 runs
)


def cfg(**changes: Any) -> ShampooConfig:
    return dataclasses.replace(BASE, **changes)


CASES: dict[str, ShampooConfig] = {
    "plain_block_scope": BASE,
    "plain_parameter_scope": cfg(grafting=adafactor(norm_scope="parameter")),
    # optax's defaults as tearfree grafts them: clip 1, parameter scale floored at 1e-3.
    "clip_and_scale": cfg(grafting=adafactor(clip_rms=1.0, parameter_scale_floor=1e-3)),
    # A clip that binds on every step, the scale floor above most rms(W) (about 1).
    "tight_clip_scale_floor_parameter_scope": cfg(
        grafting=adafactor(clip_rms=0.05, parameter_scale_floor=2.0, norm_scope="parameter")),
    # Faster decay, a filtered gradient into the graft, Shampoo from step 2, merged dims.
    "filtered_decay_0_5_merged": cfg(
        grafting=adafactor(decay_exponent=0.5, parameter_scale_floor=1e-3),
        gradient_filter=GradientFilterConfig(beta1=0.5),
        blocking=BlockingConfig(max_preconditioner_dim=8, merge_dims_up_to=16),
        schedule=ScheduleConfig(start_preconditioning_step=2)),
}


def _stepped_both(config: ShampooConfig, params: dict[str, np.ndarray],
                  grads: list[dict[str, np.ndarray]],
                  ) -> tuple[ReferenceShampoo, Shampoo, dict[str, torch.nn.Parameter],
                             list[tuple[dict[str, Any], dict[str, Any]]]]:
    """Both optimizers stepped over ``grads`` (float64); per step, the moments of each
    (torch's as arrays by key, the reference's :class:`FactoredMoments` by name)."""
    ref = ReferenceShampoo(config, params)
    tensors = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    opt = Shampoo(list(tensors.items()), config)
    moments = []
    for g in grads:
        ref.step(g)
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k])
        opt.step()
        ours = {k: {key: opt.state[t][key].numpy().copy() for key in ADAFACTOR_KEYS
                    if key in opt.state[t]} for k, t in tensors.items()}
        theirs = {k: dataclasses.replace(_moments(ref, k)) for k in tensors}
        moments.append((ours, theirs))
    return ref, opt, tensors, moments


def _moments(ref: ReferenceShampoo, name: str) -> FactoredMoments:
    graft = ref.state[name].graft
    assert isinstance(graft, FactoredMoments)
    return graft


def _assert_moments_equal(ours: dict[str, np.ndarray], theirs: Any, name: str) -> None:
    if theirs.dims is None:
        assert set(ours) == {ADAFACTOR_FULL}, name
        np.testing.assert_allclose(ours[ADAFACTOR_FULL], theirs.full, rtol=1e-12, atol=0,
                                   err_msg=name)
        return
    assert set(ours) == {ADAFACTOR_ROW, ADAFACTOR_COL}, name
    np.testing.assert_allclose(ours[ADAFACTOR_ROW], theirs.row, rtol=1e-12, atol=0, err_msg=name)
    np.testing.assert_allclose(ours[ADAFACTOR_COL], theirs.col, rtol=1e-12, atol=0, err_msg=name)


# ------------------------------------------------------------------ pieces
# --------------------------------------------------------- reference equality
@pytest.mark.parametrize("name", sorted(CASES))
def test_float64_equals_reference(name: str) -> None:
    """Moments after every step (1e-12) and parameters (1e-9) are the reference's."""
    config = CASES[name]
    params, grads = stream(seed=4100 + sorted(CASES).index(name), steps=STEPS, shapes=SHAPES)
    ref, opt, tensors, moments = _stepped_both(config, params, grads)
    for t, (ours, theirs) in enumerate(moments, start=1):
        for k in SHAPES:
            assert (theirs[k].dims is not None) == (k in FACTORED), k
            _assert_moments_equal(ours[k], theirs[k], f"{name}: {k!r} at step {t}")
    path = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, path, reference_run(config, params, grads)) <= 1e-9
    for k, p in tensors.items():  # the stepped optimizer above ends where the run does
        np.testing.assert_array_equal(p.detach().numpy(), path[-1][k])


def test_the_options_change_the_step() -> None:
    """The cases above differ where they should (so each can fail): the clip and the
    scale move the graft step of step 1, and the Shampoo step of step 3 differs from
    the graft step (a run without preconditioning)."""
    params, grads = stream(seed=4200, steps=3, shapes=SHAPES)
    plain = torch_run(BASE, params, grads, dtype=np.float64)
    for name in ("clip_and_scale", "tight_clip_scale_floor_parameter_scope"):
        other = torch_run(CASES[name], params, grads, dtype=np.float64)
        for k in SHAPES:
            assert not np.allclose(other[0][k], plain[0][k], rtol=1e-6, atol=0), (name, k)
    graft_only = torch_run(cfg(schedule=ScheduleConfig(start_preconditioning_step=100)),
                           params, grads, dtype=np.float64)
    for k in ("w", "t", "q"):
        np.testing.assert_array_equal(graft_only[1][k], plain[1][k])
        assert not np.allclose(graft_only[2][k], plain[2][k], rtol=1e-6, atol=0), k


@pytest.mark.parametrize("name", ["plain_block_scope", "clip_and_scale"])
def test_float32_within_derived_bound(name: str) -> None:
    """float32 parameters, factors and moments: within ``min(1e-2, n u kappa steps)``
    of the float64 reference (spec section 5; epsilon 1e-3 as the float32 cases of
    test_reference_equality.py)."""
    config = dataclasses.replace(CASES[name], epsilon=EpsilonConfig(value=1e-3))
    params, grads = stream(seed=4300, steps=STEPS, shapes=SHAPES)
    rtol = _float32_rtol(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float32)
    error = max_relative_error(params, ours, reference_run(config, params, grads))
    assert error <= rtol
    assert error > 0  # float32 rounding is real: the comparison sees it


# -------------------------------------------------------------------- eq. (3)
def test_refused_block_keeps_the_moments_as_the_reference() -> None:
    """Eq. (3) ``"skip_block"``: a step that refuses one block of a parameter leaves the
    whole parameter's R and C (or V) as they were; the others step as usual."""
    config = cfg(failure=FailureConfig(nonfinite_gradient="skip_block"),
                 grafting=adafactor(clip_rms=1.0, parameter_scale_floor=1e-3))
    params, grads = stream(seed=4400, steps=STEPS, shapes=SHAPES)
    grads[1]["w"][0, 0] = np.nan  # step 2, a graft step: one block of a factored matrix
    grads[3]["t"][1, 2, 3] = np.inf  # step 4, a Shampoo step: one block of a 3-tensor
    grads[4]["v"][5] = np.nan  # an unfactored vector
    ref, opt, tensors, moments = _stepped_both(config, params, grads)
    for t, (ours, theirs) in enumerate(moments, start=1):
        for k in SHAPES:
            _assert_moments_equal(ours[k], theirs[k], f"{k!r} at step {t}")
    for step, k in ((2, "w"), (4, "t"), (5, "v")):  # kept, not updated with zeros
        before, after = moments[step - 2][0][k], moments[step - 1][0][k]
        for key in before:
            np.testing.assert_array_equal(after[key], before[key])
    assert opt.metrics["skipped_blocks"] == ref.metrics.skipped_blocks == 3
    ours_path = torch_run(config, params, grads, dtype=np.float64)
    assert max_relative_error(params, ours_path, reference_run(config, params, grads)) <= 1e-9


def test_moments_enter_every_blocks_state_bound() -> None:
    """Eq. (3)'s m includes max(R, C, V) of the whole parameter for every block: with
    one entry of R at 0.75 * 2^127, a block (not the one that entry belongs to) whose
    gradient adds 0.5 * 2^127 is refused, as in the reference; the parameter's other
    blocks step. Without the moments in m nothing would be refused."""
    config = cfg(failure=FailureConfig(nonfinite_gradient="skip_block"))
    shapes = {"w": (8, 8)}
    params, grads = stream(seed=4500, steps=2, shapes=shapes)
    block = 16.0  # blocks of 4 x 4
    big = float(np.sqrt(0.5 * STATE_LIMIT / block))
    grads[1]["w"][4:, 4:] = big  # the last block of w at step 2
    ref = ReferenceShampoo(config, params)
    tensor = torch.nn.Parameter(torch.tensor(params["w"]))
    opt = Shampoo([("w", tensor)], config)
    for t, g in enumerate(grads, start=1):
        tensor.grad = torch.tensor(g["w"])
        opt.step()
        ref.step(g)
        if t == 1:  # the moments at their bound's three quarters, in both
            row = _moments(ref, "w").row
            assert row is not None
            row[0] = 0.75 * STATE_LIMIT
            opt.state[tensor][ADAFACTOR_ROW][0] = 0.75 * STATE_LIMIT
    assert ref.metrics.skipped_blocks == 1
    assert opt.metrics["skipped_blocks"] == 1
    np.testing.assert_allclose(tensor.detach().numpy(), ref.params["w"], rtol=1e-9, atol=0)
    assert np.all(np.isfinite(tensor.detach().numpy()))


# ---------------------------------------------------------------- checkpoints
def _roundtrip(sd: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded: dict[str, Any] = torch.load(buf, weights_only=True)
    return loaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["state_dict", "distributed_state_dict"])
def test_resume_is_bit_identical(dtype: torch.dtype, kind: str) -> None:
    """The moments are saved with the parameter's state and restored: a run resumed at
    step 4 continues bit for bit (a fresh optimizer's zero moments would not)."""
    config = CASES["clip_and_scale"]
    params, grads = stream(seed=4600, steps=STEPS, shapes=SHAPES)

    def make() -> tuple[Shampoo, dict[str, torch.nn.Parameter]]:
        ps = {k: torch.nn.Parameter(torch.tensor(v, dtype=dtype)) for k, v in params.items()}
        return Shampoo(list(ps.items()), config), ps

    def run(opt: Shampoo, ps: dict[str, torch.nn.Parameter], part: list[dict]) -> None:
        for g in part:
            for k, p in ps.items():
                p.grad = torch.tensor(g[k], dtype=dtype)
            opt.step()

    straight, sps = make()
    run(straight, sps, grads)
    first, fps = make()
    run(first, fps, grads[:4])
    save = getattr(first, kind)
    saved = _roundtrip(save())
    entries = saved["state"].values()
    assert all(any(key in e for key in ADAFACTOR_KEYS) for e in entries)
    assert all(bool(e[key].any()) for e in entries for key in ADAFACTOR_KEYS if key in e)
    resumed, rps = make()
    with torch.no_grad():
        for k, p in rps.items():
            p.copy_(fps[k])
    load = resumed.load_state_dict if kind == "state_dict" else resumed.load_distributed_state_dict
    load(saved)
    run(resumed, rps, grads[4:])
    for k in SHAPES:
        assert torch.equal(sps[k], rps[k]), k
        for key in ADAFACTOR_KEYS:
            if key in straight.state[sps[k]]:
                assert torch.equal(straight.state[sps[k]][key], resumed.state[rps[k]][key])
    # The fresh optimizer without the load differs (the test can fail).
    fresh, qps = make()
    with torch.no_grad():
        for k, p in qps.items():
            p.copy_(fps[k])
    run(fresh, qps, grads[4:])
    assert not all(torch.equal(sps[k], qps[k]) for k in SHAPES)


def test_a_moment_of_another_shape_is_refused() -> None:
    """The moments' shapes are checked like all state: R of a (7, 10) parameter is
    (7,), so a (10,) one (the moments of its transpose) does not load."""
    config = BASE
    p = torch.nn.Parameter(torch.zeros(7, 10, dtype=torch.float64))
    opt = Shampoo([("w", p)], config)
    p.grad = torch.ones(7, 10, dtype=torch.float64)
    opt.step()
    sd = _roundtrip(opt.state_dict())
    sd["state"][0][ADAFACTOR_ROW] = torch.ones(10, dtype=torch.float64)
    before = opt.state[p][ADAFACTOR_ROW].clone()
    with pytest.raises(ValueError, match=r"adafactor_row.*shape \(10,\) does not match \(7,\)"):
        Shampoo([("w", torch.nn.Parameter(torch.zeros(7, 10, dtype=torch.float64)))],
                config).load_state_dict(sd)
    sd["state"][0][ADAFACTOR_ROW] = torch.full((7,), float("nan"), dtype=torch.float64)
    with pytest.raises(ValueError, match="non-finite"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state[p][ADAFACTOR_ROW], before)


# ---------------------------------------------------------------- distributed
@cache
def _distributed() -> list[dict[str, Any]]:
    return spawn_ok(f"{SCENARIOS}:adafactor", 2)


def test_distributed_equals_single_process_bit_for_bit() -> None:
    """World size 2 (gloo): every rank updates the moments from the same gradient, so
    the parameters are the single process's bit for bit, with a refused block (NaN in
    "w" at step 5) and a parameter that misses step 3 (its own t)."""
    ranks = _distributed()
    for rank, r in enumerate(ranks):
        got = r["equality"]
        assert got["metrics"]["skipped_blocks"] > 0
        for n, w in got["distributed"].items():
            np.testing.assert_array_equal(w, got["single"][n], err_msg=f"{n!r}, rank {rank}")
            np.testing.assert_array_equal(w, ranks[0]["equality"]["distributed"][n])
    assert 0 < max(r["equality"]["bytes"] for r in ranks) < ranks[0]["equality"]["single_bytes"]


def test_distributed_resumes_across_world_sizes() -> None:
    for r in _distributed():
        assert r["resume"] == {"uninterrupted": True, "w_to_1": True, "one_to_w": True,
                               "blocks_complete": True, "same_dict": True}
