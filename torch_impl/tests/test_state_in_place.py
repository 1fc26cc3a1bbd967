"""State updated in place: the optimizer's tensors keep their storage from step to step.

A state tensor replaced every step is allocated among the step's temporaries and
pins the allocator's heap, which showed as peak RSS (docs/results.md, "Side by
side with Meta and Google"). The in-place forms compute the same operations in
the same order as the functional ones, so the same bits; both halves are
checked here.
"""

from __future__ import annotations

import pytest
import torch

from shampoo_spec import GraftingConfig, ScheduleConfig, ShampooConfig, StatisticsConfig
from shampoo_torch import Shampoo, grafting
from shampoo_torch.packed import SymmetricStack
from shampoo_torch.roots.eigh import eigh_error


def _storages(opt: Shampoo) -> dict[str, int]:
    """Storage address of every large state tensor: per-parameter and per block group."""
    out = {}
    for i, st in enumerate(opt.state.values()):
        for key, value in st.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                out[f"param {i} {key}"] = value.untyped_storage().data_ptr()
    for gi, gp in enumerate(opt._plans):
        for bi, bg in enumerate(gp.block_groups):
            for name, stack in (("factor", bg.factors), ("root", bg.inverse_roots)):
                for k, t in stack.items() if isinstance(stack, dict) else enumerate(stack):
                    data = t.data if isinstance(t, SymmetricStack) else t  # a packed stack's
                    key = f"group {gi} block group {bi} {name} {k}"
                    out[key] = data.untyped_storage().data_ptr()
    return out


@pytest.mark.parametrize(("graft", "beta2"), [("adagrad", 1.0), ("rmsprop", 0.99)])
def test_state_keeps_its_storage_over_statistics_and_root_steps(graft: str, beta2: float
                                                                 ) -> None:
    """Graft state, factors (Gram and rank-1 paths: matrices and vectors; sums and
    EMAs) and inverse roots stay where they were allocated, over ordinary steps and
    root steps."""
    torch.manual_seed(0)
    params = [torch.randn(6, 5, requires_grad=True), torch.randn(7, requires_grad=True)]
    cfg = ShampooConfig(
        grafting=GraftingConfig(type=graft, beta2=beta2),
        statistics=StatisticsConfig(beta2=beta2),
        schedule=ScheduleConfig(precondition_frequency=2, start_preconditioning_step=2),
    )
    opt = Shampoo(params, cfg)
    before = None
    for step in range(6):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        now = _storages(opt)
        if step == 0:  # the first step may create state lazily
            before = now
            continue
        assert now == before, f"state moved at step {step + 1}: " + ", ".join(
            k for k in now if now[k] != before.get(k))
    assert before is not None
    assert any("root" in k for k in before) and any("graft" in k for k in before)


@pytest.mark.parametrize(("kind", "beta2"), [("adagrad", 1.0), ("rmsprop", 0.9)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("g_dtype", [torch.float32, torch.float64])
def test_graft_update_in_place_equals_the_functional_form(
    kind: str, beta2: float, masked: bool, g_dtype: torch.dtype
) -> None:
    """Eq. (14b): :func:`grafting.update_state_` gives :func:`grafting.update_state`'s
    bits (``masked``: the previous value where the flag is False), in ``state``'s
    storage where the dtypes agree; a wider gradient widens the state as before."""
    torch.manual_seed(1)
    graft = GraftingConfig(type=kind, beta2=beta2)
    state = torch.rand(9, 4, dtype=torch.float32) * 3
    g = torch.randn(9, 4, dtype=g_dtype) * 1e3
    ok = torch.rand(9, 4) > 0.4 if masked else None
    expected = grafting.update_state(state, g, graft)
    if ok is not None:
        expected = torch.where(ok, expected, state)
    kept = state.clone()
    out = grafting.update_state_(kept, g, graft, ok)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)
    if g_dtype == torch.float32:
        assert out.untyped_storage().data_ptr() == kept.untyped_storage().data_ptr()
    else:
        assert torch.equal(kept, state)  # widened: the old state is left as it was


def test_eigh_error_in_place_equals_its_definition() -> None:
    """Eq. (10b)'s e = max_ij |Q^T B Q - diag(lambda)|_ij, with the diagonal subtracted
    in place, against the expression written out (NaN and -0.0 entries included)."""
    torch.manual_seed(2)
    b = torch.randn(3, 8, 8, dtype=torch.float64)
    b = b + b.mT
    lam, q = torch.linalg.eigh(b)
    lam = lam + torch.tensor([0.0, 1e-3, float("nan")], dtype=torch.float64)[:, None]
    recovered = q.mT @ (b @ q)
    written = (recovered - torch.diag_embed(lam)).abs().flatten(1).amax(dim=1)
    got = eigh_error(b, lam, q)
    assert torch.equal(got[:2], written[:2]) and got[1] > 1e-4
    assert torch.isnan(got[2]) and torch.isnan(written[2])
