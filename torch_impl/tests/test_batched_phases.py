"""The step's elementwise phases batched across parameters (foreach ops) equal the same
phases one parameter at a time, bit for bit, on both paths (:mod:`shampoo_torch.device_path`).

The accelerator path runs eqs. (3), (14b), (14c) and (15) as one ``torch._foreach_*``
op per phase for a whole cohort; the CPU path runs the same functions one parameter
at a time. Each batched helper is checked here against its one-parameter form, and
eq. (22)'s finiteness flags against ``torch.isfinite``.
"""

from __future__ import annotations

import pytest
import torch

from shampoo_spec import (
    BlockingConfig,
    GradientFilterConfig,
    GraftingConfig,
    ShampooConfig,
    WeightDecayConfig,
    plan_parameter,
)
from shampoo_torch import device_path, elementwise, grafting, updates
from shampoo_torch.block_grid import block_grid, block_max_abs, flat_block_maxima

SHAPES = [(6, 5), (5,), (3, 4), (1, 1), (7, 3)]


@pytest.fixture(params=["cpu", "accelerator"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "accelerator":
        monkeypatch.setenv(device_path.ENV, "accelerator")
    else:
        monkeypatch.delenv(device_path.ENV, raising=False)
    return str(request.param)


def _tensors(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]


def test_batches_are_one_launch_on_the_accelerator_path(path: str) -> None:
    got = device_path.batches([1, 2, 3], "cpu")
    assert got == ([[1, 2, 3]] if path == "accelerator" else [[1], [2], [3]])
    assert device_path.batches([], "cpu") == []


def test_moved_is_the_tensor_itself_where_nothing_moves() -> None:
    x = torch.ones(3)
    assert device_path.moved(x, x.device, x.dtype) is x
    assert device_path.moved(x, dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_finite_entries_are_isfinite_of_each_anded(dtype: torch.dtype) -> None:
    a, b, c = (x.reshape(-1)[:15] for x in _tensors(3, dtype)[:1] * 3)
    a, b, c = a.clone(), (a * 2).clone(), (a * 3).clone()
    a[1], b[2], c[3] = float("inf"), float("nan"), -float("inf")
    a[4] = torch.finfo(dtype).max
    b[4] = -torch.finfo(dtype).max  # a finite max beside a finite -max: no overflow
    c[5] = torch.finfo(dtype).tiny
    want = torch.isfinite(a) & torch.isfinite(b) & torch.isfinite(c)
    assert torch.equal(updates.finite_entries([a, b, c]), want)
    assert not bool(want[1:4].any()) and bool(want[4]) and bool(want[5])


def test_flat_block_maxima_are_each_parameters_block_maxima(path: str) -> None:
    cfg = ShampooConfig(blocking=BlockingConfig(max_preconditioner_dim=4))
    grids = [block_grid(plan_parameter(s, cfg), torch.device("cpu")) for s in SHAPES]
    xs = _tensors(1)
    xs[1][2] = float("nan")
    xs[4] = xs[4].double()  # a second dtype
    tensors = {pos: x.reshape(grids[pos].merged_shape) for pos, x in enumerate(xs) if pos != 2}
    got = flat_block_maxima(grids, tensors, torch.device("cpu"), torch.float64)
    want = torch.cat([block_max_abs(g, tensors[pos]).double() if pos in tensors
                      else torch.zeros(g.num_blocks, dtype=torch.float64)
                      for pos, g in enumerate(grids)])
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    singles = [block_grid(plan_parameter(s, cfg), torch.device("cpu")) for s in [(3,), (2, 2)]]
    one = {0: torch.tensor([1.0, -5.0, 2.0]), 1: torch.tensor([[0.5, 7.0], [-8.0, 1.0]])}
    assert flat_block_maxima(singles, one, torch.device("cpu"), torch.float64).tolist() == [5, 8]


@pytest.mark.parametrize("graft", [
    GraftingConfig(type="adagrad"),
    GraftingConfig(type="rmsprop", beta2=0.9),
    GraftingConfig(type="adam", beta2=0.99, epsilon_placement="inside_sqrt"),
    GraftingConfig(type="adagrad_normalized"),
])
@pytest.mark.parametrize("masked", [False, True])
def test_graft_state_and_direction_batched_equal_one_by_one(
        path: str, graft: GraftingConfig, masked: bool) -> None:
    gs, vs = _tensors(4), [x.abs() for x in _tensors(5)]
    oks = [torch.rand(x.shape, generator=torch.Generator().manual_seed(i)) > 0.3 if masked
           else None for i, x in enumerate(gs)]
    want = [grafting.update_state_(v.clone(), g, graft, ok)
            for v, g, ok in zip(vs, gs, oks, strict=True)]
    got = grafting.update_states_([v.clone() for v in vs], gs, graft, oks)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if masked:  # the optimizer's case: refused entries' gradients zeroed first
        zeroed = [torch.where(ok, g, 0.0) for g, ok in zip(gs, oks, strict=True)
                  if ok is not None]
        want_z = [grafting.update_state_(v.clone(), g, graft, ok)
                  for v, g, ok in zip(vs, zeroed, oks, strict=True)]
        got_z = grafting.update_states_([v.clone() for v in vs], zeroed, graft, oks,
                                        zeroed=True)
        assert all(torch.equal(a, b) for a, b in zip(got_z, want_z, strict=True))
    want_d = [grafting.direction(g, v, 3, graft) for g, v in zip(gs, want, strict=True)]
    got_d = grafting.directions(gs, list(got), 3, graft)
    assert all(torch.equal(a, b) for a, b in zip(got_d, want_d, strict=True))


def test_filter_batched_equals_one_by_one(path: str) -> None:
    f = GradientFilterConfig(beta1=0.9, beta3=0.8, bias_correction=True)
    gs, olds = _tensors(6), _tensors(7)
    sts = [{"filtered": x.clone()} for x in olds]
    got = elementwise.filter_gradients(sts, gs, 4, f, [None] * len(gs))
    for g, old, st, used in zip(gs, olds, sts, got, strict=True):
        new = 0.9 * old + (1.0 - 0.9) * g
        assert torch.equal(st["filtered"], new)
        assert torch.equal(used, (0.8 * old + (1.0 - 0.8) * g) / f.bias_correction_factor(4))


@pytest.mark.parametrize("decay", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_updates_batched_equal_one_by_one_and_flag_what_they_withheld(
        decay: bool, masked: bool) -> None:
    """Eqs. (21)-(22): the batched update writes the same parameters as one by one,
    and flags a parameter exactly when an admitted entry was withheld."""
    cfg = ShampooConfig(weight_decay=WeightDecayConfig(value=0.1, type="update") if decay
                        else WeightDecayConfig())
    ws, us = _tensors(8), _tensors(9)
    us[0][0, 0] = float("inf")  # withheld where admitted...
    us[1][2] = float("nan")
    us[2][1, 1] = float("nan")
    oks: list[torch.Tensor | None] = [None] * len(ws)
    if masked:  # ...not where refused: parameter 1, and parameter 2's entry (0, 0)
        oks = [torch.tensor(True), torch.tensor(False), torch.ones(3, 4, dtype=torch.bool),
               torch.tensor(True), None]
        assert oks[2] is not None
        oks[2][0, 0] = False
        us[2][0, 0] = float("nan")
    one = [w.clone() for w in ws]
    want = [bool(updates.apply_update(p, w, u, {}, {}, cfg, 0.5, ok))
            for p, w, u, ok in zip(one, ws, us, oks, strict=True)]
    batch = [w.clone() for w in ws]
    got = updates.apply_updates(batch, ws, us, cfg, 0.5, oks)
    assert all(torch.equal(a, b) for a, b in zip(batch, one, strict=True))
    assert got.tolist() == want
    assert want[0] and want[1] != masked and want[2] and not want[3]
