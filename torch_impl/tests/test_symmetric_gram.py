"""One triangle of each large factor (blocks.gram_update_, eq. 6): checked against
the float64 closed form ``beta C + alpha G G^T`` and, through the whole optimizer,
against the reference on a parameter whose factors take that path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shampoo_conformance.adapters.torch import run as torch_run
from shampoo_reference import run as reference_run
from shampoo_spec import BlockingConfig, EpsilonConfig, ScheduleConfig, ShampooConfig
from shampoo_torch.blocks import SYMMETRIC_GRAM_MIN, contraction_operands, gram_update_
from shampoo_torch.device_path import on_cpu_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("shape", "k"), [((2, SYMMETRIC_GRAM_MIN + 1, 40), 0),
                                          ((1, 30, SYMMETRIC_GRAM_MIN), 1),
                                          ((2, 5, 4), 0)])  # below the size: whole GEMM
def test_gram_update_is_the_closed_form_and_symmetric(
    dtype: torch.dtype, shape: tuple[int, ...], k: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(shape, generator=gen, dtype=dtype)
    g0 = torch.randn(shape, generator=gen, dtype=dtype)
    a0, b0 = contraction_operands(g0, k)
    c = a0 @ b0  # a symmetric positive semi-definite start
    c = (c + c.mT) / 2
    expected = 0.9 * c.double() + 0.1 * (g.double().movedim(k + 1, 1).flatten(2)
                                         @ g.double().movedim(k + 1, 1).flatten(2).mT)
    a, b = contraction_operands(g, k)
    out = gram_update_(c, a, b, 0.9, 0.1)
    assert out is c  # in place
    m = c.shape[-1]
    h = m // 2
    if m >= SYMMETRIC_GRAM_MIN and on_cpu_path(c.device):  # one triangle, the other its mirror
        assert torch.equal(c[:, :h, h:], c[:, h:, :h].mT)
    # Each entry: a dot product of K terms, each term and the sum rounded once
    # (|error| <= K u sum |a_i b_i| <= K u ||row||^2, bounded by the diagonals).
    contraction = g[0].numel() // shape[k + 1]
    unit = torch.finfo(dtype).eps / 2
    bound = 2 * (contraction + 2) * unit * expected.diagonal(dim1=1, dim2=2).max()
    assert (c.double() - expected).abs().max() <= bound


def test_the_optimizer_with_large_factors_equals_the_reference() -> None:
    """A (SYMMETRIC_GRAM_MIN + 2, 3) parameter: its left factor takes one triangle;
    float64, 6 steps, displacement within 1e-9 relative (spec section 5)."""
    rng = np.random.default_rng(0)
    n = SYMMETRIC_GRAM_MIN + 2
    params = {"w": rng.standard_normal((n, 3))}
    grads = [{"w": rng.standard_normal((n, 3))} for _ in range(6)]
    config = ShampooConfig(
        learning_rate=0.1,
        blocking=BlockingConfig(max_preconditioner_dim=n),
        epsilon=EpsilonConfig(value=1e-3),
        schedule=ScheduleConfig(precondition_frequency=2),
    )
    ref = reference_run(config, params, grads)
    ours = torch_run(config, params, grads, dtype=np.float64)
    for r, o in zip(ref, ours, strict=True):
        d_ref, d_ours = r["w"] - params["w"], o["w"] - params["w"]
        assert np.linalg.norm(d_ours - d_ref) <= 1e-9 * np.linalg.norm(d_ref)
