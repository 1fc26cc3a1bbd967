"""Symmetric matrices stored as one triangle (``shampoo_torch.packed``).

The layout is checked against its definition (the lower triangle, mirrored),
the direct statistics updates against eq. (6) written out on full matrices,
and the optimizer against the same optimizer with full storage.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shampoo_spec import EpsilonConfig, ScheduleConfig, ShampooConfig, StatisticsConfig
from shampoo_torch import Shampoo, blocks
from shampoo_torch.packed import PACKED_MIN, SymmetricStack, packed_size

SIZES = [1, 2, 3, 4, 5, 10, 17, 64, 65]


def _mirrored(a: torch.Tensor) -> torch.Tensor:
    """The symmetric matrices whose lower triangles are ``a``'s."""
    return torch.tril(a) + torch.tril(a, -1).mT


@pytest.mark.parametrize("n", SIZES)
def test_round_trip_keeps_the_lower_triangle(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(3, n, n, generator=gen, dtype=torch.float64)
    stack = SymmetricStack.from_full(a)
    assert stack.data.shape == (3, packed_size(n)) and packed_size(n) == n * (n + 1) // 2
    assert stack.shape == (3, n, n) and len(stack) == 3
    assert torch.equal(stack.unpack(), _mirrored(a))
    assert torch.equal(stack.unpack(slice(1, 3)), _mirrored(a[1:]))
    assert torch.equal(stack.row(2), _mirrored(a)[2])
    # Every stored entry is used: the data is a permutation of the triangle's entries.
    tri = a[:, *torch.tril_indices(n, n)]
    assert torch.equal(stack.data.sort(dim=1).values, tri.sort(dim=1).values)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rows", [None, slice(1, 3), torch.tensor([2, 0])], ids=str)
def test_pack_into_rows_leaves_the_others(n: int, rows: torch.Tensor | slice | None) -> None:
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(3, n, n, generator=gen, dtype=torch.float64)
    new = torch.randn(3, n, n, generator=gen, dtype=torch.float64)
    stack = SymmetricStack.from_full(a)
    want = _mirrored(a)
    index = torch.arange(3) if rows is None else torch.arange(3)[rows]
    part = new[: len(index)]
    stack.pack_(rows, part)
    want[index] = _mirrored(part)
    assert torch.equal(stack.unpack(), want)


def test_pack_refuses_another_size() -> None:
    stack = SymmetricStack.from_full(torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match="3, 3"):
        stack.pack_(None, torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="5 x 5"):
        SymmetricStack(torch.zeros(2, 10), 5)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rows", [None, slice(1, 3)], ids=str)
def test_gram_update_is_eq6_on_the_triangle(n: int, rows: slice | None) -> None:
    """``beta L + alpha G G^T`` by blocks equals the whole product's lower triangle to
    round-off (each entry the same dot product, summed perhaps in another order)."""
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(3, n, 7, generator=gen, dtype=torch.float64)
    a0 = g @ g.mT
    stack = SymmetricStack.from_full(a0)
    sl = slice(None) if rows is None else rows
    stack.gram_update_(rows, g[sl], g[sl].mT, 0.9, 0.5)
    want = a0.clone()
    want[sl] = 0.9 * a0[sl] + 0.5 * (g[sl] @ g[sl].mT)
    torch.testing.assert_close(stack.unpack(), _mirrored(want), rtol=1e-14, atol=1e-14)
    if rows is not None:
        assert torch.equal(stack.unpack(slice(0, 1)), _mirrored(a0[:1]))


@pytest.mark.parametrize("n", [2, 3, 10, 65, 300])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gram_update_with_beta_zero_and_one(n: int, beta: float) -> None:
    """``beta = 1`` adds the product to L; ``beta = 0`` replaces L and, as BLAS, never
    reads it (a NaN there is not carried)."""
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(2, n, 5, generator=gen, dtype=torch.float64)
    a0 = torch.randn(2, n, n, generator=gen, dtype=torch.float64)
    stack = SymmetricStack.from_full(a0)
    if beta == 0.0:
        stack.data[0, ::3] = float("nan")
    stack.gram_update_(None, g, g.mT, beta, 0.5)
    want = 0.5 * (g @ g.mT) + (_mirrored(a0) if beta == 1.0 else 0.0)
    torch.testing.assert_close(stack.unpack(), _mirrored(want), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 17, 64, 65, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [None, slice(1, 3), torch.tensor([2, 0])], ids=str)
def test_matvec_is_the_symmetric_product(n: int, dtype: torch.dtype,
                                         rows: torch.Tensor | slice | None) -> None:
    """``X v`` from the stored triangle equals the unpacked matrix times v, each entry
    within the dot product's bound ``n u sum_j |X_ij v_j|`` (spec section 5)."""
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(3, n, n, generator=gen, dtype=dtype)
    stack = SymmetricStack.from_full(a)
    index = torch.arange(3) if rows is None else torch.arange(3)[rows]
    v = torch.randn(len(index), n, generator=gen, dtype=dtype)
    full = stack.unpack(rows).double()
    got = stack.matvec(rows, v)
    assert got.shape == v.shape and got.dtype == dtype
    want = (full @ v.double()[..., None])[..., 0]
    magnitude = (full.abs() @ v.double().abs()[..., None])[..., 0]
    bound = (n + 2) * torch.finfo(dtype).eps / 2 * magnitude
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("beta", "weight"), [(None, 1.0), (0.9, 1.0), (0.9, 0.1)])
def test_rank1_update_is_the_full_update_bit_for_bit(n: int, beta: float | None,
                                                     weight: float) -> None:
    """Each stored entry is ``beta L_ij + g_i g_j`` (or ``+ w (g_i g_j)``) as the whole
    update computes it: the same operations on the same numbers."""
    gen = torch.Generator().manual_seed(n)
    a0 = torch.randn(3, n, n, generator=gen)
    g = torch.randn(3, n, generator=gen)
    stack = SymmetricStack.from_full(a0)
    stack.rank1_update_(slice(1, 3), g[1:], beta, weight)
    outer = g[1:, :, None] * g[1:, None, :]
    outer = outer if weight == 1.0 else weight * outer
    full = _mirrored(a0)
    want = full.clone()
    want[1:] = (full[1:] * beta if beta is not None else full[1:]) + outer
    assert torch.equal(stack.unpack(), _mirrored(want))


def _run(config: ShampooConfig, packed: bool, monkeypatch: pytest.MonkeyPatch
         ) -> tuple[list[torch.nn.Parameter], Shampoo]:
    monkeypatch.setattr(blocks, "PACKED_MIN", PACKED_MIN if packed else 10**9)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64))
              for shape in ((12, 9), (9,), (4, 5, 6))]
    opt = Shampoo(params, config)
    for _ in range(7):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        opt.step()
    return params, opt


@pytest.mark.cpu_path  # factors are packed on the CPU path only
@pytest.mark.parametrize("beta2", [1.0, 0.95])
def test_optimizer_packed_equals_full_storage(beta2: float,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed and full storage take the same steps to round-off (float64), and the
    packed state is n (n + 1) / 2 entries per factor and root.

    The two differ by where the factor's and the root's rounding asymmetry goes
    (mirrored, or kept): n u ||X|| per root entry, with epsilon 1e-3 a condition
    number of at most about 1e3 after the ridge: 7 steps x 1e3 x 1.1e-16 ~ 1e-12
    (docs/spec.md section 5, the float64 bound)."""
    config = dataclasses.replace(
        ShampooConfig(learning_rate=0.05, factor_dtype="float64"),
        epsilon=EpsilonConfig(value=1e-3),
        statistics=StatisticsConfig(beta2=beta2),
        schedule=ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2))
    full, opt_full = _run(config, False, monkeypatch)
    packed, opt_packed = _run(config, True, monkeypatch)
    for a, b in zip(full, packed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    views = list(opt_packed.blocks())
    kinds = {type(s).__name__ for gp in opt_packed._plans for bg in gp.block_groups
             for s in (*bg.factors.values(), *bg.inverse_roots.values())}
    assert kinds == {"SymmetricStack"}
    matrices = [t for v in views for t in (*(v.factors or ()), *(v.inverse_roots or ()))
                if t is not None]
    saved = sum((t.numel() - packed_size(t.shape[-1])) * t.element_size() for t in matrices)
    assert saved > 0
    assert opt_full.block_state_bytes() - opt_packed.block_state_bytes() == saved
