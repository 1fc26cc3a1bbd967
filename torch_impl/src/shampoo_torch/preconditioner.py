"""The Kronecker preconditioner, one block group at a time (docs/spec.md eqs. 6-18).

Every function works on one :class:`~shampoo_torch.blocks.BlockGroup` (the
equal-shape blocks of a param group, stacked ``[B, ...]``) and on ``rows``,
the rows of it taking part this step (None: all; see
:func:`~shampoo_torch.blocks.select_rows`). ``ok`` is the per-row flag of
eq. (3) ``"skip_block"`` (:mod:`shampoo_torch.refusal`; None: every row
steps); a row whose flag is False keeps its state unchanged. The stacked
state is replaced or written in place (:func:`~shampoo_torch.blocks.put`).

Batch invariance (:mod:`shampoo_torch.invariance`): a block's result does not
depend on the other rows of its group, so one process and the distributed
optimizer (which stacks only a rank's blocks) agree bit for bit. Hence the
elementwise rank-1 statistics update, the ``rowwise`` powers (inside the
eigh and Newton roots too; the stored-dtype, higher-order and QR roots run
``rowwise`` whole), and the row-major inverse roots below.

The optimizer calls these functions through this module
(``preconditioner.refresh_inverse_roots(...)``), so a benchmark can time a
phase by wrapping the module attribute (``python -m shampoo_conformance.bench.torch_distributed``
times :func:`refresh_inverse_roots` that way).
"""

from __future__ import annotations

from functools import partial

import torch

from shampoo_spec import (
    CoupledNewtonConfig,
    EigenvalueCorrectionConfig,
    EighConfig,
    ShampooConfig,
    SpectralDescentConfig,
    StatisticsConfig,
)

from . import grafting, roots
from .blocks import (
    BlockGroup,
    Rows,
    contraction_operands,
    gram_on_triangle,
    gram_update_,
    mode_product,
    mode_product_in,
    put,
    row_chunks,
    row_count,
    take,
)
from .device_path import on_cpu_path, scalar
from .elementwise import _SCALE_DTYPES, stored_with_diagonal
from .invariance import rowwise
from .packed import SymmetricStack


def _per_row(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` of shape [B] viewed to broadcast against a stack ``like`` [B, ...]."""
    return x.view(-1, *([1] * (like.dim() - 1)))


def _count(counter: torch.Tensor, rows: Rows, ok: torch.Tensor | None) -> torch.Tensor:
    """``counter[rows] + 1`` (only where ``ok``), written back; the new stacked counter.
    All rows or a run of them: one add in place (a bool ``ok`` adds as 0 or 1)."""
    if rows is None or isinstance(rows, slice):
        take(counter, rows).add_(1 if ok is None else ok)
        return counter
    n = take(counter, rows)
    return put(counter, rows, n + (1 if ok is None else ok.long()))


def update_statistics(
    bg: BlockGroup, gb: torch.Tensor, rows: Rows, ok: torch.Tensor | None,
    stats: StatisticsConfig, zero_refused: bool = False,
) -> None:
    """Eq. (6): ``L_k <- beta2 L_k + w G_(k) G_(k)^T`` as batched GEMMs per dim
    (one triangle of a large factor, :func:`~shampoo_torch.blocks.gram_update_`; a
    packed factor's stored triangle, :meth:`~shampoo_torch.packed.SymmetricStack.gram_update_`
    and :meth:`~shampoo_torch.packed.SymmetricStack.rank1_update_`).

    ``gb`` is the rows' gradient blocks ``[len(rows), *bg.shape]`` (G^ of
    eq. 6c: the averaged gradients with ``frequent_directions.average_gradients``);
    ``n`` of eq. (7) counts the update. A sketched factor (eq. 6c) takes this
    step's observation ``C_k = G_(k) G_(k)^T`` only (no decay, no sum), folded
    into its sketch at the root step (eq. 10d). A 1-d block contracts over
    nothing (``G G^T`` is an outer product); there the update is elementwise,
    because CPU ``baddbmm`` fuses a rank-1 update differently for one batch row
    than for several, which would make a block's factor depend on its group.

    ``zero_refused``: the rows ``ok`` refuses have ``gb`` 0 (eq. 3's refused
    gradients, zeroed). On the accelerator path every row is then updated in
    place, the refused ones decayed by 1 so that they keep their factor exactly
    (``1 L + w 0``): one scaling per factor where a copy, an update and a
    select would be three launches and three passes over the factors. The
    decay is then its own product (``beta2 L``, then ``+ w G G^T``), as eq. (11b).
    """
    beta2, weight = stats.beta2, stats.update_weight
    masked_in_place = (ok is not None and zero_refused and not stats.quantized
                       and bg.storage_dtype is None and not on_cpu_path(bg.device)
                       and not any(isinstance(f, SymmetricStack) for f in bg.factors.values()))
    decay = None
    if masked_in_place and stats.decays:
        assert ok is not None
        decay = torch.where(ok, scalar(beta2, bg.dtype, bg.device),
                            scalar(1.0, bg.dtype, bg.device)).view(-1, 1, 1)  # per factor row
    # All rows, or a run of them (views): the factors are updated where they are (a
    # packed one in its triangle); a packed factor's rows by index are unpacked into a
    # new tensor, updated there and packed.
    writable = ok is None and not stats.quantized
    for k in bg.dims:
        factor = bg.factors[k]
        fresh = isinstance(factor, SymmetricStack)  # take() gives a new tensor
        in_place = writable and (fresh or not isinstance(rows, torch.Tensor))
        # On the triangle itself (sketched factors and eq. 11b's take the branches
        # before): a packed factor's rows as a run.
        direct = fresh and in_place and not isinstance(rows, torch.Tensor)
        gk = gb
        if stats.kl:  # eq. (6b): G x_{j != k} X_j with the roots held before this step
            for j in bg.dims:
                if j != k:
                    gk = mode_product(gk, take(bg.inverse_roots[j], rows), j)
        a, b = contraction_operands(gk, k)
        if k in bg.sketches:  # eq. (6c): C_k, this step's observation only
            old = take(bg.factors[k], rows)
            new = a * b if a.shape[-1] == 1 else gram_update_(torch.zeros_like(old), a, b,
                                                              0.0, 1.0)
        elif bg.storage_dtype is not None:
            # Eq. (11b): the decay on the stored factor in its dtype (torch takes
            # beta2 in float32 and rounds to s, as Meta's _foreach_mul_), the sum with
            # w G G^T in the working precision, rounded once to s (Meta's add_).
            outer = a * b if a.shape[-1] == 1 else torch.bmm(a, b)
            old = take(bg.factors[k], rows)
            decayed = old.mul(beta2) if stats.decays else old
            new = decayed.to(bg.dtype).add(outer, alpha=weight).to(bg.storage_dtype)
        elif masked_in_place:  # see the docstring
            target = take(bg.factors[k], rows)
            if decay is not None:
                target.mul_(decay)
            if a.shape[-1] == 1:  # entry by entry, as below
                target.add_(a * b if weight == 1.0 else weight * (a * b))
            else:
                gram_update_(target, a, b, 1.0, weight)
            if isinstance(rows, torch.Tensor):
                bg.factors[k] = put(bg.factors[k], rows, target)
            continue
        elif a.shape[-1] == 1:  # rank-1 update: products, scalings and sums entry by entry
            if direct and a.dtype == factor.dtype:
                assert isinstance(factor, SymmetricStack) and not isinstance(rows, torch.Tensor)
                factor.rank1_update_(rows, b[:, 0], beta2 if stats.decays else None, weight)
                continue
            outer = a * b if weight == 1.0 else weight * (a * b)
            old = take(bg.factors[k], rows)
            if in_place and outer.dtype == old.dtype:  # the same sum, into the state
                (old.mul_(beta2) if stats.decays else old).add_(outer)
                if fresh:
                    bg.factors[k] = put(bg.factors[k], rows, old)
                continue
            new = outer + (beta2 * old if stats.decays else old)
        elif direct and gram_on_triangle(a, b):
            assert isinstance(factor, SymmetricStack) and not isinstance(rows, torch.Tensor)
            factor.gram_update_(rows, a, b, beta2, weight)
            continue
        elif in_place:
            new = gram_update_(take(bg.factors[k], rows), a, b, beta2, weight)
            if fresh:
                bg.factors[k] = put(bg.factors[k], rows, new)
            continue
        else:
            old = take(bg.factors[k], rows)
            new = gram_update_(old.clone(), a, b, beta2, weight)
        if stats.quantized:  # eq. (20c): stored, read back from here on
            new = stored_with_diagonal(new, _SCALE_DTYPES[stats.scale_dtype])
        if ok is not None:
            new = torch.where(ok[:, None, None], new, old)
        bg.factors[k] = put(bg.factors[k], rows, new)
    assert bg.statistics_updates is not None
    bg.statistics_updates = _count(bg.statistics_updates, rows, ok)


def _trace_scale(trace: torch.Tensor, eps: float, tau: float) -> torch.Tensor:
    """Eq. (7b)'s factor ``max(tr A, eps)^(-tau)`` per row."""
    return torch.clamp_min(trace, eps) ** -tau


def _bias_corrections(bg: BlockGroup, rows: Rows, stats: StatisticsConfig
                      ) -> torch.Tensor | None:
    """Eq. (7)'s ``1 - beta2^n`` per row (1 before the first update); None without it."""
    if not stats.corrects_bias:
        return None
    assert bg.statistics_updates is not None
    n = take(bg.statistics_updates, rows)
    power = rowwise(lambda x: torch.pow(stats.beta2, x), n.to(bg.dtype))  # batch invariance
    return torch.where(n > 0, 1.0 - power, torch.ones_like(power))


def _root_input(a: torch.Tensor, bc: torch.Tensor | None, cfg: ShampooConfig) -> torch.Tensor:
    """A of eq. (10) from the factors ``a`` (in the factor dtype): bias corrected by
    ``bc`` (eq. 7), then scaled by ``max(tr A, eps)^(-tau)`` (eq. 7b)."""
    stats = cfg.statistics
    if bc is not None:
        a = a / bc[:, None, None]
    if stats.trace_scaling_exponent > 0:  # eq. (7b), per row
        trace = torch.diagonal(a, dim1=-2, dim2=-1).sum(-1)
        # pow one row per call: batch invariance
        scale = rowwise(partial(_trace_scale, eps=cfg.epsilon.value,
                                tau=stats.trace_scaling_exponent), trace)
        a = a * scale[:, None, None]
    return a


def largest_eigenvalues(
    bg: BlockGroup, k: int, rows: Rows, ok: torch.Tensor | None, cfg: ShampooConfig
) -> torch.Tensor:
    """Eq. (10g)'s terms: lambda_max(A_{b,k}) of factor k of each row of ``rows``, ``[B]``
    (A as eq. 10 decomposes it: eq. 7, eq. 7b); -inf for a row that takes no part: not
    admitted this step (``ok`` False, eq. 3: it keeps its roots), or with a non-finite A
    (or one whose eigenvalues cannot be computed). In row chunks
    (:func:`~shampoo_torch.blocks.row_chunks`), as :func:`refresh_inverse_roots`.
    """
    assert k not in bg.sketches and bg.storage_dtype is None  # the config refuses them
    bc = _bias_corrections(bg, rows, cfg.statistics)
    count = row_count(rows, len(bg))
    row_bytes = bg.factors[k].shape[-1] ** 2 * torch.finfo(bg.dtype).bits // 8
    parts = []
    for part, part_rows in row_chunks(rows, count, row_bytes, bg.device):
        a = _root_input(take(bg.factors[k], part_rows), None if bc is None else bc[part], cfg)
        parts.append(roots.largest_eigenvalues(a))
    top = parts[0] if len(parts) == 1 else torch.cat(parts)
    return top if ok is None else torch.where(ok, top, -torch.inf)


def refresh_inverse_roots(
    bg: BlockGroup, rows: Rows, ok: torch.Tensor | None, cfg: ShampooConfig, t: int,
    scales: dict[int, torch.Tensor] | None = None, largest: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. (7), (9)-(13): new inverse roots (or eigenbases, eq. 17) of every factor.

    Each factor is bias corrected (eq. 7), then ``X_k = (L_k + eps)^(-1/r_k)``
    by eigendecomposition (eqs. 9-10) or coupled Newton (eq. 11); with
    eigenvalue correction the eigenbasis Q_k instead, computed in the factor
    dtype. With ``inverse_root_dtype`` the result is then rounded to it
    (eq. 11a: ``X^ = round_s(X)``, torch's round-to-nearest-even cast, as
    Meta's ``.to(dtype=inv_factor_matrix.dtype)``). A failed or non-finite
    result (after the rounding: a float16 root can overflow) keeps the
    previous one and is counted (eq. 13): Newton's failure (eq. 11), or an
    eigendecomposition whose error e reaches ``EighConfig.failure_threshold``
    tau, ``fl32(e) >= fl32(tau)``. A sketched factor (eq. 10d, at step ``t``)
    folds its observation into its sketch instead (:func:`_fold_sketch`). The
    eigh, Newton, eigenbasis and sketch roots take a chunk's rows in one call
    with their powers per row, the others one block per call on CPU
    (:func:`~shampoo_torch.invariance.rowwise`); all are stored row-major, so
    later matmuls pick the same kernel for a block whatever its batch; the
    rows of a factor go in chunks (:func:`~shampoo_torch.blocks.row_chunks`),
    each accepted into the state before the next is read, so the step's
    temporaries do not grow with the group.

    ``scales`` (eq. 10g, ``epsilon.rank_cutoff_scope="parameter"``): per dim k,
    Lambda_k of each row's parameter (``[len(rows)]``, from :func:`largest_eigenvalues`
    maxed over the parameter's blocks), which scales the row's rank cutoff in place
    of its own lambda_max; None: eq. (10)'s own cutoffs.
    ``largest``: the largest factor of the param group, by which eq. (10d)'s
    ``packing = "google"`` reads a smaller sketch's values back.

    Returns ``(consecutive failures of each row after this root step,
    the number of factors that failed)``, both device tensors; the limit of
    eq. (13) is checked by the caller.
    """
    assert bg.statistics_updates is not None and bg.consecutive_failures is not None
    n = take(bg.statistics_updates, rows)
    bc = _bias_corrections(bg, rows, cfg.statistics)  # eq. (7)
    failed_any = torch.zeros(n.shape[0], dtype=torch.bool, device=bg.device)
    failures = torch.zeros((), dtype=torch.int64, device=bg.device)
    method = cfg.root_inverse
    # Eq. (10b): fl32(tau) for eigh roots and eigenbases (None: no error computed).
    tau = method.failure_threshold_float32 if isinstance(method, EighConfig) else None
    count = n.shape[0]
    for k in bg.dims:
        # The rows in chunks (blocks.WORKSPACE_BYTES), each accepted into the state
        # before the next is read: bounded temporaries (the factors are computed on
        # in bg.dtype, at least as wide as their storage).
        row_bytes = bg.factors[k].shape[-1] ** 2 * torch.finfo(bg.dtype).bits // 8
        for part, part_rows in row_chunks(rows, count, row_bytes, bg.device):
            part_ok = None if ok is None else ok[part]
            if k in bg.sketches:
                failed = _fold_sketch(bg, k, part_rows, part_ok, cfg, t, largest)
            else:
                failed = _refresh_rows(
                    bg, k, part_rows, part_ok, None if bc is None else bc[part], cfg, tau,
                    None if scales is None else scales[k][part], largest)
            failures = failures + failed.sum()
            failed_any[part] |= failed
    consecutive = take(bg.consecutive_failures, rows)
    updated = torch.where(failed_any, consecutive + 1, torch.zeros_like(consecutive))
    if ok is not None:
        updated = torch.where(ok, updated, consecutive)
    bg.consecutive_failures = put(bg.consecutive_failures, rows, updated)
    return updated, failures


def _refresh_rows(
    bg: BlockGroup, k: int, rows: Rows, ok: torch.Tensor | None, bc: torch.Tensor | None,
    cfg: ShampooConfig, tau: float | None, scale: torch.Tensor | None = None,
    largest: int = 0,
) -> torch.Tensor:
    """The new inverse root (or eigenbasis) of factor k of ``rows``, accepted in place
    where it passed and ``ok``; returns the rows that failed (eq. 13). ``scale``: eq.
    (10g)'s Lambda_k per row (the config allows it with plain eigh roots only).
    ``largest``: the param group's largest factor (eq. 11d's ``deflation_padding``)."""
    stats = cfg.statistics
    a = take(bg.factors[k], rows)
    if bg.storage_dtype is not None:  # eq. (11b): the root in s
        if bc is not None:  # float32 division, rounded to s (Meta's 0-d divisor)
            a = (a.float() / bc.float()[:, None, None]).to(bg.storage_dtype)
        new, good = roots.root_inverse_in_storage_dtype(a, bg.roots[k], cfg.epsilon, bg.dtype)
        new = new.contiguous().to(bg.root_dtype)  # eq. (11a) when set; exact otherwise
        return _accept(bg, k, rows, new, good & roots.finite_rows(new), ok)
    a = _root_input(a, bc, cfg)  # eqs. (7), (7b)
    ec = cfg.eigenvalue_correction
    basis = None
    if roots.starts_from_basis(cfg):  # eq. (17c): the roots are the bases; eqs. (10f), (10h)
        basis = take((bg.eigenbases if ec is None else bg.inverse_roots)[k], rows)
    new, good, new_basis = roots.compute_inverse_root(a, bg.roots[k], cfg, tau, basis, scale)
    method = cfg.root_inverse
    if isinstance(method, CoupledNewtonConfig) and method.fails_padded(a.shape[-1], largest):
        good = torch.zeros_like(good)  # eq. (11d): Google's padded deflation fails it
    if new_basis is not None:  # eqs. (10f), (10h)
        assert basis is not None
        _store_basis(bg, k, rows, ok, basis, new_basis, good)
    # Row-major, whatever layout the decomposition returned (:mod:`.invariance`).
    new = new.contiguous()
    if bg.rounds_roots:
        new = new.to(bg.root_dtype)  # eq. (11a); elementwise, so batch invariant
        good = good & roots.finite_rows(new)
    if ec is not None and ec.basis_reuse_tolerance > 0 and ec.eigenbasis_method == "eigh":
        # Eq. (17b): a row whose stored eigenbasis still fits keeps it (no failure).
        prev = take(bg.inverse_roots[k], rows)
        fits = rowwise(
            partial(roots.basis_still_fits, eps=cfg.epsilon,
                    tolerance=ec.basis_reuse_tolerance),
            torch.stack([prev.to(a.dtype), a], dim=1),
        ) & roots.finite_rows(a)
        new = torch.where(fits[:, None, None], prev, new.to(prev.dtype))
        good = good | fits
    if stats.quantized:  # eq. (20c): the accepted root is stored
        new = stored_with_diagonal(new, _SCALE_DTYPES[stats.scale_dtype])
    return _accept(bg, k, rows, new, good, ok)


def _store_basis(
    bg: BlockGroup, k: int, rows: Rows, ok: torch.Tensor | None, prev: torch.Tensor,
    basis: torch.Tensor, good: torch.Tensor,
) -> None:
    """Eqs. (10f), (10h): the new eigenbasis of factor k of ``rows`` is stored where its
    root is accepted (good and ``ok``, as :func:`_accept`; eq. 13), ``prev`` kept elsewhere."""
    keep = good if ok is None else (good & ok)
    basis = torch.where(keep[:, None, None], basis, prev).contiguous()
    bg.eigenbases[k] = put(bg.eigenbases[k], rows, basis)


def _fold_sketch(
    bg: BlockGroup, k: int, rows: Rows, ok: torch.Tensor | None, cfg: ShampooConfig, t: int,
    largest: int = 0,
) -> torch.Tensor:
    """Eq. (10d) (eq. 10e with ``frequent_directions.rule = "tearfree"``) at root step t
    for sketched factor k of ``rows`` (:func:`shampoo_torch.roots.dispatch.sketch_root`): the
    sketch takes the observation C_k of eq. (6c) (no eq. 7 or 7b: the config refuses them);
    the new sketch is stored where the row steps (``ok``) whatever X is, X by eq. (13)
    (:func:`_accept`); returns the rows that failed."""
    stored = bg.sketches[k]
    sketch = stored.take(rows)
    new, x, good = roots.sketch_root(sketch, take(bg.factors[k], rows), bg.roots[k], cfg, t,
                                     largest)
    if ok is not None:
        new = stored.take(rows).where(ok, new)
    stored.put(rows, new)
    return _accept(bg, k, rows, x, good, ok)


def _accept(bg: BlockGroup, k: int, rows: Rows, new: torch.Tensor, good: torch.Tensor,
            ok: torch.Tensor | None) -> torch.Tensor:
    """Eq. (13): store the new root of factor k of ``rows`` where it is good and the row
    steps (``ok``), keep the previous one elsewhere; returns the rows that failed."""
    keep_new = good if ok is None else (good & ok)
    old = take(bg.inverse_roots[k], rows)
    # Written over ``old`` (the state itself when ``rows`` is None): no third [B, n, n]
    # tensor, and the roots keep their storage (see grafting.update_state_).
    into = old if new.dtype == old.dtype and new.shape == old.shape else None
    bg.inverse_roots[k] = put(
        bg.inverse_roots[k], rows, torch.where(keep_new[:, None, None], new, old, out=into)
    )
    return ~good if ok is None else (~good & ok)


def rotate(bg: BlockGroup, x: torch.Tensor, rows: Rows, transpose: bool) -> torch.Tensor:
    """Eq. (17): ``X x_k Q_k^T`` (``transpose``, into the eigenbasis) or ``X x_k Q_k`` (back).

    With eigenbases stored in another dtype q than the factors (eq. 17a) the
    rotation is computed in q, as Meta's ``_precondition_grad``: ``x`` cast
    to q, every mode product rounded to q (:func:`~shampoo_torch.blocks.mode_product_in`),
    the result cast back to the factor dtype. A block with no preconditioned
    dim is not cast.
    """
    if bg.rounds_roots and bg.dims:
        assert bg.root_dtype is not None
        x = x.to(bg.root_dtype)
        for k in bg.dims:
            x = mode_product_in(x, take(bg.inverse_roots[k], rows), k, bg.root_dtype,
                                transpose=transpose)
        return x.to(bg.dtype)
    for k in bg.dims:
        x = mode_product(x, take(bg.inverse_roots[k], rows), k, transpose=transpose)
    return x


def update_corrected_moment(
    bg: BlockGroup, gb: torch.Tensor, rows: Rows, ok: torch.Tensor | None,
    ec: EigenvalueCorrectionConfig,
) -> None:
    """Eq. (17): ``D <- beta2 D + w (G x_k Q_k^T)^2`` in the current basis (a sum
    when ``beta2 == 1``; w = ``ec.update_weight``).

    With ``corrected_eigenvalues_dtype`` s (eq. 17a) Meta's operations on D
    in s: ``D * beta2`` (torch takes beta2 in D's precision, float32 below
    float64, and rounds to s), then ``addcmul`` with weight w (1 for a sum)
    computed in the factor dtype and rounded to s once.
    ``gb`` arrives in the eigenbases' dtype when they are stored in another
    (:func:`rotate` then casts nothing).
    """
    assert bg.corrected is not None and bg.corrected_updates is not None
    rotated = rotate(bg, gb, rows, transpose=True)
    old = take(bg.corrected, rows)
    if ec.corrected_eigenvalues_dtype is not None:
        decayed = old * ec.beta2 if ec.decays else old
        weight = ec.update_weight if ec.decays else 1.0
        new = torch.addcmul(decayed.to(rotated.dtype), rotated, rotated,
                            value=weight).to(old.dtype)
    elif ec.decays:
        new = ec.beta2 * old + ec.update_weight * rotated**2
    else:
        new = old + rotated**2
    if ok is not None:
        new = torch.where(_per_row(ok, new), new, old)
    bg.corrected = put(bg.corrected, rows, new)
    bg.corrected_updates = _count(bg.corrected_updates, rows, ok)


def corrected_direction(
    bg: BlockGroup, fb: torch.Tensor, rows: Rows, ec: EigenvalueCorrectionConfig
) -> torch.Tensor:
    """Eq. (17): ``((F x_k Q_k^T) / ((D / bc)^(1/root) + eps)) x_k Q_k``.

    With ``corrected_eigenvalues_dtype`` s (eq. 17a) the denominator is
    Meta's ``D.div(bc).pow_(1 / root).add_(eps)`` in s: bc taken in D's
    precision (float32 below float64), each operation rounded to s; the
    quotient in the factor dtype.
    """
    assert bg.corrected is not None and bg.corrected_updates is not None
    d = take(bg.corrected, rows)
    bc = None
    if ec.corrects_bias:  # one power per row (batch invariance)
        n = take(bg.corrected_updates, rows)
        power = rowwise(lambda x: torch.pow(ec.beta2, x), n.to(bg.dtype))
        bc = torch.where(n > 0, 1.0 - power, torch.ones_like(power))
    rounded = ec.corrected_eigenvalues_dtype is not None
    if bc is not None:
        if rounded:  # Meta's D.div(bc): bc in D's compute precision, the quotient in s
            compute = torch.float64 if d.dtype == torch.float64 else torch.float32
            d = (d.to(compute) / _per_row(bc.to(compute), d)).to(d.dtype)
        else:
            d = d / _per_row(bc, d)
    rotated = rotate(bg, fb, rows, transpose=True)
    # sqrt (batch invariant); other exponents one block per call.
    root = ec.root_for(len(bg.shape))  # the block order
    root_d = torch.sqrt(d) if root == 2 else rowwise(lambda x: x ** (1.0 / root), d)
    scaled = torch.div(rotated, root_d + ec.epsilon)
    if rounded:
        scaled = scaled.to(bg.dtype)  # Meta's in-place div_ keeps the gradient's dtype
    return rotate(bg, scaled, rows, transpose=False)


def shampoo_direction(
    bg: BlockGroup, fb: torch.Tensor, rows: Rows, cfg: ShampooConfig
) -> torch.Tensor:
    """The preconditioned direction of each row from its filtered gradient blocks ``fb``.

    Eq. (16): ``P = F x_1 X_1 x_2 X_2 ...`` over the preconditioned dims, or
    eq. (17) with eigenvalue correction. With ``inverse_root_dtype`` s the
    products are in s, as Meta's (``fb`` arrives rounded to s; every mode
    product rounded to s, :func:`~shampoo_torch.blocks.mode_product_in`) and P
    goes back to the factor dtype for eqs. (18)-(21), as Meta casts it back
    to the gradient's dtype.
    """
    if cfg.spectral is not None:
        return orthogonalize(fb, cfg.spectral)
    if cfg.eigenvalue_correction is not None:
        return corrected_direction(bg, fb, rows, cfg.eigenvalue_correction)
    pb = fb
    if bg.rounds_roots:
        assert bg.root_dtype is not None
        for k in bg.dims:
            pb = mode_product_in(pb, take(bg.inverse_roots[k], rows), k, bg.root_dtype)
        return pb.to(bg.dtype)
    for k in bg.dims:
        root = bg.inverse_roots[k]
        if isinstance(root, SymmetricStack) and pb.dim() == 2:
            pb = root.matvec(rows, pb)  # a 1-d block: X g from the triangle, not unpacked
            continue
        # Eq. (20c): a read-back root is applied as Google does, X^T on its dim.
        pb = mode_product(pb, take(root, rows), k, transpose=cfg.statistics.quantized)
    return pb


def orthogonalize(fb: torch.Tensor, spectral: SpectralDescentConfig) -> torch.Tensor:
    """Eq. (16c) for a stack of matrices ``fb`` ``[B, m, n]``: each orthogonalized.

    ``"svd"``: ``U_r V_r^T`` of each reduced SVD over the singular values above
    ``max(m, n) eps s_max`` (times ``sum(S)`` with ``scale_by_nuclear_norm``).
    ``"newton_schulz"``: each divided by ``max(||.||_F, 1e-8)``, transposed when
    m < n so the Gram matrix ``X^T X`` is the smaller one, then
    ``X <- a X + X (b A + c A A)``, ``A = X^T X``, in batched matrix products.
    """
    if spectral.method == "svd":
        u, sv, vt = torch.linalg.svd(fb, full_matrices=False)
        # The pairs above the rank tolerance max(m, n) eps s_max only: the others'
        # vectors are arbitrary (shampoo_reference.linalg.svd_rank_tolerance).
        tol = max(fb.shape[1:]) * torch.finfo(fb.dtype).eps * sv.amax(dim=-1, keepdim=True)
        out: torch.Tensor = (u * (sv > tol).to(u.dtype)[:, None, :]) @ vt
        if spectral.scale_by_nuclear_norm:
            out = out * sv.sum(dim=-1)[:, None, None]
        return out
    x = fb / torch.clamp(torch.linalg.matrix_norm(fb), min=1e-8)[:, None, None]
    transpose = fb.shape[1] < fb.shape[2]
    if transpose:
        x = x.transpose(1, 2)
    a, b, c = spectral.coefficients
    for _ in range(spectral.num_iterations):
        gram = x.transpose(1, 2) @ x
        x = torch.baddbmm(x, x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), beta=a)
    return x.transpose(1, 2) if transpose else x


def rescale_blocks_to_graft(
    pb: torch.Tensor, gd: torch.Tensor, norm_epsilon: float, in_place: bool = False
) -> torch.Tensor:
    """Eq. (18) per block: ``P * ||graft(F)|| / (||P|| + norm_epsilon)`` for each row
    (``in_place``: written over ``pb``, the same products).

    The norms cannot overflow for finite directions (:func:`shampoo_torch.grafting.norm`).
    On the accelerator path (:mod:`.device_path`) a float32 or narrower stack takes the
    scale whole in float64 (both norms' squares summed in float64, as ``grafting.norm``,
    the quotient rounded once to the stack's dtype): four launches for the stack and no
    view, where the norms rounded first take eight. Within an ulp of the scale from the
    rounded norms.
    """
    if grafting.widens_norm(pb):
        dims = tuple(range(1, pb.dim()))
        wide = torch.linalg.vector_norm(gd, dim=dims, keepdim=True, dtype=torch.float64)
        wide = wide.div_(torch.linalg.vector_norm(pb, dim=dims, keepdim=True,
                                                  dtype=torch.float64).add_(norm_epsilon))
        factor = wide.to(pb.dtype)
        return pb.mul_(factor) if in_place else pb * factor
    scale = _norms(gd) / (_norms(pb) + norm_epsilon)
    return pb.mul_(scale) if in_place else pb * scale


def rescale_to_graft(
    p: torch.Tensor, graft_dir: torch.Tensor, norm_epsilon: float
) -> torch.Tensor:
    """Eq. (18) per parameter: the same rescale with the norms of the whole parameter."""
    scale = grafting.norm(graft_dir) / (grafting.norm(p) + norm_epsilon)
    out: torch.Tensor = p * scale
    return out


def _norms(x: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of each block of a stack ``[B, ...]``, shaped to broadcast
    (:func:`shampoo_torch.grafting.norm`: no overflow for finite blocks)."""
    return _per_row(grafting.norm(x.flatten(1), dim=1), x)
