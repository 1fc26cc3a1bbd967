"""The accelerator path's fewer launches give the CPU path's values.

A param group's per-block vectors are kept across steps with each one-block
parameter's entry as a 0-d view made once (:class:`shampoo_torch.block_grid.BlockVectors`);
eq. (3)'s maxima, eq. (22)'s flags and eq. (18)'s block scales written through them,
or taken whole in float64, must equal what the one-by-one forms give: bit for bit
where the arithmetic is the same, within the stated ulp where it is not.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shampoo_spec import BlockingConfig, ShampooConfig, WeightDecayConfig, plan_parameter
from shampoo_torch import device_path, preconditioner, updates
from shampoo_torch.block_grid import BlockVectors, block_grid, flat_block_maxima

SHAPES = [(6, 5), (5,), (3, 4), (1, 1), (7, 3)]


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(device_path.ENV, "accelerator")


def _tensors(seed: int, shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64).float() for s in shapes]


def _grids(shapes: list[tuple[int, ...]], block: int) -> list:
    cfg = ShampooConfig(blocking=BlockingConfig(max_preconditioner_dim=block))
    return [block_grid(plan_parameter(s, cfg), torch.device("cpu")) for s in shapes]


def test_a_kept_vectors_single_views_are_its_one_block_entries() -> None:
    grids = _grids(SHAPES, 4)  # (6, 5) and (7, 3) take several blocks
    kept = BlockVectors(grids).get("x", torch.float64, torch.device("cpu"))
    assert set(kept.single) == {pos for pos, g in enumerate(grids) if g.num_blocks == 1}
    for pos, view in kept.single.items():
        view.fill_(pos + 1.0)
    offsets = [sum(g.num_blocks for g in grids[:pos]) for pos in range(len(grids))]
    assert [kept.data[offsets[pos]].item() for pos in kept.single] == [
        pos + 1.0 for pos in kept.single]
    assert BlockVectors(grids).get("x", torch.float64, torch.device("cpu")).data.sum() == 0


@pytest.mark.parametrize("absent", [None, 2])
def test_maxima_written_into_a_kept_vector_equal_the_stacked_ones(
        accelerator: None, absent: int | None) -> None:
    grids = _grids(SHAPES, 4)
    xs = _tensors(5)
    xs[1][3] = float("nan")
    xs[3][0, 0] = -float("inf")
    tensors = {pos: x.reshape(grids[pos].merged_shape) for pos, x in enumerate(xs)
               if pos != absent}
    cpu = torch.device("cpu")
    want = flat_block_maxima(grids, tensors, cpu, torch.float64)
    into = BlockVectors(grids).get("m", torch.float64, cpu)
    into.data.fill_(7.0)  # last step's values: every entry is rewritten
    got = flat_block_maxima(grids, tensors, cpu, torch.float64, into)
    assert got is into.data
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("refused", [False, True])
@pytest.mark.parametrize("decay", [False, True])
def test_updates_through_kept_flags_equal_one_by_one(
        accelerator: None, refused: bool, decay: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eq. (22) with eq. (3)'s flags folded into ``x - x`` writes what ``apply_update``
    writes, and flags per block exactly the parameters that withheld an admitted entry."""
    calls = []
    by_block = updates._withheld_by_block

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return by_block(*args)

    monkeypatch.setattr(updates, "_withheld_by_block", counted)
    shapes = [(4, 3), (5,), (2, 2), (3, 1)]
    grids = _grids(shapes, 16)  # one block each
    cfg = ShampooConfig(weight_decay=WeightDecayConfig(value=0.1, type="update") if decay
                        else WeightDecayConfig())
    ws, us = _tensors(8, shapes), _tensors(9, shapes)
    us[0][1, 1] = float("inf")  # withheld, admitted
    us[1][0] = float("nan")  # withheld; refused below when `refused`
    vectors = BlockVectors(grids)
    ok = None
    single: dict[int, torch.Tensor] = {}
    if refused:
        kept_ok = vectors.get("admitted", torch.bool, torch.device("cpu"))
        ok = torch.eq(torch.tensor([0, 2, 0, 1], dtype=torch.int32), 0, out=kept_ok.data)
        single = kept_ok.single
    oks = [single.get(pos) for pos in range(len(shapes))]
    one = [w.clone() for w in ws]
    want = [bool(updates.apply_update(p, w, u, {}, {}, cfg, 0.5, o))
            for p, w, u, o in zip(one, ws, us, oks, strict=True)]
    batch = [w.clone() for w in ws]
    positions = [0, 1, 2, 3]
    got = updates.apply_updates(batch, ws, us, cfg, 0.5, oks,
                                updates.KeptVectors(vectors, ok, single, positions))
    assert all(torch.equal(a, b) for a, b in zip(batch, one, strict=True))
    assert got.tolist() == want
    assert want == [True, not refused, False, False]
    assert calls == [1]  # the kept-vector form, not the per-parameter one


def test_updates_of_some_parameters_flag_no_other_block(accelerator: None) -> None:
    shapes = [(4, 3), (5,), (2, 2)]
    vectors = BlockVectors(_grids(shapes, 16))
    vectors.get("withheld", torch.float32, torch.device("cpu")).data.fill_(float("nan"))
    ws, us = _tensors(3, shapes), _tensors(4, shapes)
    us[1][0] = float("nan")
    got = updates.apply_updates(ws[1:], ws[1:], us[1:], ShampooConfig(), 0.5, [None, None],
                                updates.KeptVectors(vectors, None, {}, [1, 2]))
    assert got.tolist() == [False, True, False]


@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 7)])
def test_block_scales_in_float64_are_the_rescale_rounded_once(
        accelerator: None, shape: tuple[int, ...]) -> None:
    """Eq. (18) per block on the accelerator path: ``||gd|| / (||pb|| + eps)`` computed
    in float64 and rounded once, the product then rounded as float32's; entries of
    1e30 whose squares overflow float32 give the same scales scaled."""
    gen = torch.Generator().manual_seed(2)
    pb = torch.randn(shape, generator=gen, dtype=torch.float64).float()
    gd = torch.randn(shape, generator=gen, dtype=torch.float64).float()
    eps = 1e-12
    dims = tuple(range(1, len(shape)))
    scale = (gd.double().square().sum(dims).sqrt()
             / (pb.double().square().sum(dims).sqrt() + eps)).float()
    want = pb * scale.view(-1, *[1] * len(dims))
    got = preconditioner.rescale_blocks_to_graft(pb.clone(), gd, eps, in_place=True)
    # The float64 sums of squares may differ from the reference's order by an ulp of
    # float64, far below float32's: the rounded scales are equal but for a tie.
    assert torch.allclose(got, want, rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    big = preconditioner.rescale_blocks_to_graft(pb * 1e30, gd * 1e30, eps)
    assert bool(torch.isfinite(big).all())
    assert torch.allclose(big, want * 1e30, rtol=4 * torch.finfo(torch.float32).eps, atol=0)


def test_count_adds_the_admitted_rows_in_place() -> None:
    counter = torch.tensor([3, 0, 5])
    kept = preconditioner._count(counter, None, torch.tensor([True, False, True]))
    assert kept is counter and counter.tolist() == [4, 0, 6]
    preconditioner._count(counter, slice(1, 3), None)
    assert counter.tolist() == [4, 1, 7]
    new = preconditioner._count(counter, torch.tensor([0, 2]), torch.tensor([False, True]))
    assert new.tolist() == [4, 1, 8]


def test_device_scalars_are_made_once() -> None:
    cpu = torch.device("cpu")
    nan = device_path.scalar(math.nan, torch.float32, cpu)
    assert nan is device_path.scalar(float("nan"), torch.float32, cpu)
    assert nan.dim() == 0 and math.isnan(nan.item())
    assert device_path.scalar(1, torch.int32, cpu).dtype == torch.int32


def test_held_factor_maxima_equal_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eq. (3)'s m from the factors: one foreach inf-norm for the one-row stacks of
    one-block parameters (accelerator path) equals the CPU path's max and min."""
    from shampoo_torch import Shampoo, refusal

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(6, 5), (5,), (3, 4), (4, 3), (7,)]]
    opt = Shampoo(params, ShampooConfig(blocking=BlockingConfig(max_preconditioner_dim=4)))
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    gp = opt._plans[0]
    monkeypatch.delenv(device_path.ENV, raising=False)
    want = refusal._held_maxima(gp, torch.device("cpu"), torch.float64).clone()
    monkeypatch.setenv(device_path.ENV, "accelerator")
    got = refusal._held_maxima(gp, torch.device("cpu"), torch.float64)
    assert bool((want > 0).all()) and torch.equal(got, want)
