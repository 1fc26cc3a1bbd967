"""Eq. (3): which blocks' steps are refused, decided before any state changes.

A block's step is refused when its gradient (after eq. 2's L2 decay) holds a
non-finite entry, or when ``shampoo_spec.block_overflows(max|G_B|, |B|, m)``:
``m + |B| max|G_B|^2 > shampoo_spec.STATE_LIMIT``, m being the largest
absolute entry of the block's state (its factors, the graft state on its
slice, the eigenvalue-corrected moment D; 0 where absent; eq. 14e's Adafactor
moments R, C, V of the whole parameter for every block of it). Such a gradient
could carry the state out of float32's range (a sum of squares of 1e20 is
inf), so it is treated exactly like a non-finite one: raised under
``"raise"``, skipped and counted under ``"skip_block"``.

:func:`block_codes` computes the decision for every block of a param group
at once, on the device and without a host sync: one separable max per
parameter over its blocks (:func:`~shampoo_torch.blocks.block_max_abs`) for
the gradient and the graft state, one max per row of each block group's
factors and moment (max |x| over the whole factor, not its diagonal: a
loaded factor need not be PSD), and the bound on the param group's flat
vector of blocks (every parameter's blocks in order, as
:class:`~shampoo_torch.state.ParamGroupPlan` numbers them). The bound is
computed in float64 (float32 where the device has no float64), so the
decision matches the reference's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shampoo_spec import STATE_LIMIT, factor_limit

from .blocks import BlockGroup, block_max_abs
from .cohorts import StepInput
from .grafting import adafactor_max_abs
from .packed import SymmetricStack

OK, TOO_LARGE, NONFINITE = 0, 1, 2
CODE_DTYPE = torch.int32


def bound_dtype(device: torch.device) -> torch.dtype:
    """float64, or float32 on a device without float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _row_max_abs(bg: BlockGroup) -> torch.Tensor | None:
    """``[B]``: the largest absolute entry of each row's factors and corrected moment."""
    out = None
    # A packed factor's triangle holds every entry of the symmetric matrix.
    stacks = [*(f.data if isinstance(f, SymmetricStack) else f for f in bg.factors.values()),
              *([] if bg.corrected is None else [bg.corrected])]
    for x in stacks:
        if x.shape[0] == 0 or x[0].numel() == 0:
            continue
        flat = x.flatten(1)  # max and min: no |x| temporary (torch.aminmax is slow on CPU)
        m = torch.maximum(flat.amax(dim=1), -flat.amin(dim=1))
        out = m if out is None else torch.maximum(out, m)
    return out


def block_codes(inp: StepInput, state: Mapping[torch.Tensor, Any]) -> torch.Tensor:
    """Eq. (3) per block of ``inp``'s param group, in flat order: ``[blocks]`` int32.

    :data:`OK`, :data:`TOO_LARGE` or :data:`NONFINITE` (a non-finite
    gradient entry); blocks of parameters without a gradient are OK. On the
    first parameter's device; distributed, only the blocks held here
    contribute their factors (the optimizer all-reduces the codes).
    """
    gp = inp.gp
    device = inp.params[0].device
    dt = bound_dtype(device)
    total = gp.total_blocks
    held = torch.zeros(total, dtype=dt, device=device)
    for bg, flat in zip(gp.block_groups, gp.flat_rows, strict=True):
        rows = _row_max_abs(bg)
        if rows is not None:
            held.index_copy_(0, flat.to(device), rows.to(device, dt))
    zeros = torch.zeros(total, dtype=dt, device=device)
    g_parts, m_parts, f_parts = [], [], []
    for pos, grid in enumerate(gp.grids):
        lo, hi = gp.offsets[pos], gp.offsets[pos] + grid.num_blocks
        if pos not in inp.g:
            g_parts.append(zeros[lo:hi])
            m_parts.append(zeros[lo:hi])
            f_parts.append(zeros[lo:hi])
            continue
        g_parts.append(block_max_abs(grid, inp.g[pos]).to(device, dt))
        m = held[lo:hi]
        f_parts.append(m)  # the factors alone (no corrected moment with stored factors)
        st = state[inp.params[pos]]
        for key in ("graft", "diagonal"):  # V of eq. (14b), V_D of eq. (16b)
            elementwise = st.get(key)
            if elementwise is not None:
                m = torch.maximum(m, block_max_abs(grid, elementwise).to(device, dt))
        moments = adafactor_max_abs(st)
        if moments is not None:  # eq. (14e): R, C, V span the parameter, so every block's m
            m = torch.maximum(m, moments.to(device, dt))
        m_parts.append(m)
    gmax, m = torch.cat(g_parts), torch.cat(m_parts)
    assert gp.block_sizes is not None
    bound = m + gp.block_sizes.to(device, dt) * gmax * gmax  # as shampoo_spec.block_overflows
    codes = torch.where(bound <= STATE_LIMIT, OK, TOO_LARGE)
    limit = factor_limit(gp.config.factor_storage_dtype)
    if limit is not None:  # float16 factors (eq. 11b): m_f + |B| g^2 <= 2^15 too
        factor_bound = torch.cat(f_parts) + gp.block_sizes.to(device, dt) * gmax * gmax
        codes = torch.where(factor_bound <= limit, codes, TOO_LARGE)
    codes = torch.where(torch.isfinite(gmax), codes, NONFINITE)
    return codes.to(CODE_DTYPE)
