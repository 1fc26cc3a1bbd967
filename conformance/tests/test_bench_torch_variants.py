"""The variants of ``shampoo_conformance.bench.torch_variants`` each change the one option
they name."""

from __future__ import annotations

import dataclasses

import torch

from shampoo_conformance.bench.torch_variants import variants
from shampoo_torch import Shampoo


def test_each_variant_changes_its_option_and_steps() -> None:
    configs = variants(period=2)
    base = configs["shampoo"]
    changed = {name: {f.name for f in dataclasses.fields(base)
                      if getattr(c, f.name) != getattr(base, f.name)}
               for name, c in configs.items() if name != "diagonal_adam"}
    assert changed == {"shampoo": set(), "kl": {"statistics"},
                       "spectral": {"spectral", "blocking"}, "sign": {"diagonal"},
                       "gpa": {"averaging"}, "schedule_free": {"averaging"},
                       "low_rank": {"low_rank"},
                       "frequent_directions": {"frequent_directions", "statistics", "schedule"},
                       "sketchy_tearfree": {"frequent_directions", "statistics", "schedule"},
                       "eigendecomposed_qr": {"root_inverse"},
                       "coupled_newton": {"root_inverse", "epsilon"},
                       "coupled_newton_deflated": {"root_inverse", "epsilon"},
                       "adafactor_graft": {"grafting"}}
    assert configs["diagonal_adam"].diagonal is not None
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    for name, config in configs.items():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        opt = Shampoo(m.parameters(), config)
        before = [p.detach().clone() for p in m.parameters()]
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        assert all(torch.isfinite(p).all() for p in m.parameters()), name
        assert any(not torch.equal(p.detach(), b) for p, b in zip(m.parameters(), before,
                                                                   strict=True)), name
