"""Eq. (10f) in torch against the reference's ``root_inverse_qr``, row by row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shampoo_reference.roots.basis import root_inverse_qr
from shampoo_spec import EpsilonConfig
from shampoo_torch.roots.basis import root_inverse_qr as torch_root


def spd(n: int, cond: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    lam = np.logspace(0, -np.log10(cond), n)
    return (q * lam) @ q.T


@pytest.mark.parametrize("placement", ["ridge", "shift_after"])
@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_torch_qr_root_equals_the_reference(placement: str, iterations: int) -> None:
    """Eq. (10f) in torch, row by row of a stack: X and the new basis as
    ``root_inverse_qr`` (LAPACK's QR in both: the same signs)."""
    rng = np.random.default_rng(20 + iterations)
    mats = [spd(6, 1e2, seed=s) for s in (3, 4)]
    bases = [np.linalg.qr(rng.standard_normal((6, 6)))[0] for _ in mats]
    eps = EpsilonConfig(value=1e-3, placement=placement)  # type: ignore[arg-type]
    for tolerance in (0.0, 0.05):
        pair = torch.tensor(np.stack([np.stack(bases), np.stack(mats)], axis=1))
        out, ok = torch_root(pair, 4.0, eps, iterations, tolerance)
        assert bool(ok.all())
        for k, (a, b) in enumerate(zip(mats, bases, strict=True)):
            want = root_inverse_qr(b, a, 4.0, 1e-3, placement, iterations, tolerance)
            assert want is not None
            np.testing.assert_allclose(out[k, 0].numpy(), want[0], rtol=0, atol=1e-11)
            np.testing.assert_allclose(out[k, 1].numpy(), want[1], rtol=0, atol=1e-12)
