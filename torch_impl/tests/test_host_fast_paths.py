"""CPU shortcuts that read a flag on the host (no device to sync with): eq. (22)'s
update guard skips its per-entry test when every entry is finite, and eq. (18)'s
overflow-safe norm skips its scaled form when the plain norm is finite. Each must
give what the full path gives, and fall back to it whenever a sum is not finite."""

from __future__ import annotations

import math

import pytest
import torch

from shampoo_spec import ShampooConfig
from shampoo_torch import grafting, updates

BIG = 3e38  # finite in float32; two of them sum to inf


@pytest.mark.cpu_path  # the host reads are the CPU path's
@pytest.mark.parametrize(("values", "expected"), [
    ([1.0, -2.0, 0.0], True),
    ([1.0, math.inf], False),
    ([1.0, math.nan], False),
    ([BIG, BIG], False),  # every entry finite, the sum is not: the exact test decides
])
def test_all_finite_on_host_is_never_true_for_a_non_finite_entry(
    values: list[float], expected: bool
) -> None:
    assert updates.all_finite_on_host([torch.tensor(values)]) is expected


def _guarded(w: torch.Tensor, u: torch.Tensor, lr: float) -> tuple[torch.Tensor, bool]:
    """Eq. (22) written out: the new entry where finite, else the old one."""
    new = w - lr * u
    return torch.where(torch.isfinite(new), new, w), bool((~torch.isfinite(new)).any())


@pytest.mark.parametrize(("w", "u", "withheld_any"), [
    ([1.0, -2.0, 3.0, 0.5], [0.5, 1.0, -1.0, 2.0], False),  # the shortcut
    ([1.0, BIG, BIG, 0.5], [0.5, 1.0, -1.0, 2.0], False),  # entries finite, sum inf
    ([1.0, BIG, BIG, 0.5], [0.5, -1e38, 1.0, 2.0], True),  # one entry overflows
])
def test_update_guard_equals_the_per_entry_rule(
    w: list[float], u: list[float], withheld_any: bool
) -> None:
    old, direction = torch.tensor(w), torch.tensor(u)
    p = old.clone()
    withheld = updates.apply_update(p, old, direction, {}, {}, ShampooConfig(), 1.0, None)
    expected, any_withheld = _guarded(old, direction, 1.0)
    assert torch.equal(p, expected)
    assert bool(withheld) is any_withheld is withheld_any


def test_safe_norm_is_the_plain_norm_where_finite_and_scaled_where_not() -> None:
    x = torch.tensor([[3.0, 4.0], [1e20, 1e20]])  # the second row's squares overflow
    rows = grafting.norm(x, dim=1)
    assert torch.equal(rows[0], torch.linalg.vector_norm(x[0]))
    assert rows[1].item() == pytest.approx(math.sqrt(2) * 1e20, rel=1e-6)
    assert torch.equal(grafting.norm(x[:1]), torch.linalg.vector_norm(x[:1]))
