"""``Shampoo.blocks()``: the public read-only view of the block state matches the state.

After steps with ``beta2 = 1`` each factor is the plain sum of ``G_(k) G_(k)^T``
over the steps (eq. 6), computed here in NumPy from the shape plan; the inverse
roots are ``(L + eps I)^(-1/r)`` (eq. 10); the counters count the updates.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from shampoo_spec import (
    BlockingConfig,
    EigenvalueCorrectionConfig,
    EpsilonConfig,
    ShampooConfig,
    plan_parameter,
)
from shampoo_torch import BlockView, Shampoo
from shampoo_torch.packed import PACKED_MIN

SHAPES = {"w": (6, 5), "v": (3,), "s": (), "skipped": (50,)}
CONFIG = ShampooConfig(
    learning_rate=0.01,
    epsilon=EpsilonConfig(value=1e-3),
    blocking=BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None, skip_dim_size_gt=40),
    factor_dtype="float64",
)
STEPS = 3


def _run(config: ShampooConfig) -> tuple[Shampoo, dict[str, list[np.ndarray]]]:
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
              for n, s in SHAPES.items()}
    opt = Shampoo(list(params.items()), config)
    grads: dict[str, list[np.ndarray]] = {n: [] for n in SHAPES}
    for _ in range(STEPS):
        for n, p in params.items():
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            grads[n].append(p.grad.numpy().copy())
        opt.step()
    return opt, grads


def _expected_factor(gs: list[np.ndarray], merged: tuple[int, ...], slices: tuple[slice, ...],
                     k: int) -> np.ndarray:
    total = np.zeros((len(range(*slices[k].indices(merged[k]))),) * 2)
    for g in gs:
        x = g.reshape(merged)[slices]
        other = [d for d in range(x.ndim) if d != k]
        total += np.tensordot(x, x, axes=(other, other))
    return total


def test_views_match_the_plan_and_the_state() -> None:
    opt, grads = _run(CONFIG)
    views = list(opt.blocks())
    assert all(isinstance(v, BlockView) for v in views)
    expected_keys = []
    for pos, (name, shape) in enumerate(SHAPES.items()):
        plan = plan_parameter(shape, CONFIG)
        if plan.preconditioned:
            expected_keys += [(0, pos, name, b) for b in range(len(plan.blocks))]
    assert [(v.param_group, v.parameter, v.name, v.block) for v in views] == expected_keys
    for v in views:
        plan = plan_parameter(SHAPES[v.name], CONFIG)
        block = plan.blocks[v.block]
        assert v.shape == tuple(block.shape) and v.roots == tuple(block.roots)
        assert v.held and v.owner is None
        assert v.statistics_updates == STEPS and v.consecutive_failures == 0
        assert v.corrected is None and v.corrected_updates is None
        assert v.factors is not None and v.inverse_roots is not None
        assert len(v.factors) == len(v.shape) == len(v.inverse_roots)
        for k, (factor, inverse_root) in enumerate(zip(v.factors, v.inverse_roots,
                                                       strict=True)):
            assert factor is not None and inverse_root is not None
            want = _expected_factor(grads[v.name], plan.merged_shape, block.slices, k)
            np.testing.assert_allclose(factor.numpy(), want, rtol=1e-12, atol=1e-12)
            lam, q = np.linalg.eigh(want + 1e-3 * np.eye(len(want)))
            root = (q * lam ** (-1.0 / v.roots[k])) @ q.T
            np.testing.assert_allclose(inverse_root.numpy(), root, rtol=1e-8, atol=1e-10)


def test_views_are_read_only_and_fresh() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(4, 3, generator=gen, dtype=torch.float64))
    opt = Shampoo([p], CONFIG)
    (before,) = opt.blocks()
    assert before.statistics_updates == 0
    assert before.factors is not None and before.inverse_roots is not None
    assert all(f is not None and not f.any() for f in before.factors)  # zero (eq. 6)
    assert all(torch.equal(x, torch.eye(x.shape[0], dtype=torch.float64))
               for x in before.inverse_roots if x is not None)  # identity (eq. 13)
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.statistics_updates = 5  # type: ignore[misc]
    p.grad = torch.ones(4, 3, dtype=torch.float64)
    opt.step()
    (after,) = opt.blocks()
    assert after.statistics_updates == 1
    assert after.factors is not None and after.factors[0] is not None
    assert torch.equal(after.factors[0], torch.full((4, 4), 3.0, dtype=torch.float64))


@pytest.mark.cpu_path  # packed factor bytes: CPU path only
def test_eigenvalue_correction_views_and_state_bytes() -> None:
    config = dataclasses.replace(CONFIG, eigenvalue_correction=EigenvalueCorrectionConfig())
    opt, _ = _run(config)
    views = list(opt.blocks())
    assert views and all(v.corrected is not None and v.corrected_updates == STEPS for v in views)
    assert all(v.corrected is not None and tuple(v.corrected.shape) == v.shape for v in views)
    # Factors are stored as one triangle (n (n + 1) / 2 entries), the eigenbases whole.
    def stored(t: torch.Tensor, packed: bool) -> int:
        n = t.shape[-1]
        return (n * (n + 1) // 2 if packed and n >= PACKED_MIN else t.numel()) * t.element_size()

    total = sum(stored(t, True) for v in views for t in v.factors or () if t is not None)
    total += sum(stored(t, False) for v in views for t in (*(v.inverse_roots or ()), v.corrected)
                 if t is not None)
    counters = 3 * 8 * len(views)  # statistics, consecutive failures, corrected updates: int64
    assert opt.block_state_bytes() == total + counters
    assert opt.exchange_bytes == 0


def test_package_never_imports_conformance() -> None:
    code = ("import sys, shampoo_torch, shampoo_torch.processes; "
            "assert not [m for m in sys.modules if m.startswith('shampoo_conformance')]")
    subprocess.run([sys.executable, "-c", code], check=True)
