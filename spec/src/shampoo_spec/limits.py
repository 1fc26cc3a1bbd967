"""The numeric limits every backend enforces alike (docs/spec.md eqs. 3 and 5).

- :func:`block_overflows`: eq. (3)'s second reason to refuse a block's step.
  A finite gradient so large that the block's state (factors, graft state,
  corrected moment) could leave float32's range is refused exactly like a
  non-finite gradient: raised under ``"raise"``, skipped and counted under
  ``"skip_block"``. The test is a bound computed before any state changes,
  from quantities every backend has: ``m + |B| g^2 > STATE_LIMIT``, where
  ``g`` is the largest absolute gradient entry of block B, ``|B|`` its number
  of entries and ``m`` the largest absolute entry of its state so far. Each
  new state term is at most ``|B| g^2`` (a factor entry sums at most ``|B|``
  products of two gradient entries; ``||G||^2 <= |B| g^2``), and each update
  keeps ``|new| <= |old| + |term|`` (weights <= 1), so a block that passes
  cannot overflow float32 in this step. The limit is float32's whatever the
  dtype, so every backend (and the float64 reference) makes the same decision.
- :data:`LARGE_BLOCK_DIM` and :func:`large_block_warnings`: a block with a
  dim above this limit has factors of more than 256 MiB in float32 and roots
  that take seconds; backends warn, naming the parameter, when a plan has one.
"""

from __future__ import annotations

from .plan import ParameterPlan

#: Half of float32's largest finite value (2^128 (1 - 2^-24)): the most any
#: state entry may reach, with room for one more addition of the same size.
STATE_LIMIT = 2.0**127

#: Half of float16's range (its largest finite value is 65504 < 2^16): the most a factor
#: stored in float16 (``factor_storage_dtype``, eq. 11b) may reach, with the same margin.
FLOAT16_FACTOR_LIMIT = 2.0**15

#: Block dims above this get a warning (a 8192 x 8192 float32 factor is 256 MiB).
LARGE_BLOCK_DIM = 8192


def block_overflows(gradient_max_abs: float, block_size: int, state_max_abs: float,
                    factor_max_abs: float = 0.0, factor_limit: float | None = None) -> bool:
    """Eq. (3): whether a block's step must be refused although its gradient is finite.

    ``gradient_max_abs``: max |G_B| (after L2 decay, eq. 2); ``block_size``:
    |B|; ``state_max_abs``: the largest absolute entry of the block's factors,
    graft state and corrected second moment (0 when it has none). With
    ``factor_limit`` (:func:`factor_limit`: float16 factors, eq. 11b) also
    ``factor_max_abs + |B| g^2 > factor_limit``, ``factor_max_abs`` the
    largest absolute entry of the block's factors. A NaN in either magnitude
    also refuses the block.
    """
    term = block_size * gradient_max_abs * gradient_max_abs
    if factor_limit is not None and not factor_max_abs + term <= factor_limit:
        return True
    return not state_max_abs + term <= STATE_LIMIT


def factor_limit(factor_storage_dtype: str | None) -> float | None:
    """Eq. (3)'s limit on the factors alone: :data:`FLOAT16_FACTOR_LIMIT` for factors stored in
    float16 (eq. 11b), else None (bfloat16 has float32's range: STATE_LIMIT covers it)."""
    return FLOAT16_FACTOR_LIMIT if factor_storage_dtype == "float16" else None


def large_block_warnings(name: str, plan: ParameterPlan) -> list[str]:
    """Warnings for the blocks of ``plan`` with a dim above :data:`LARGE_BLOCK_DIM`.

    Empty for every plan of the default config (blocks of at most 1024).
    """
    big = sorted({n for b in plan.blocks for n, r in zip(b.shape, b.roots, strict=True)
                  if r != 0 and n > LARGE_BLOCK_DIM})
    if not big:
        return []
    return [
        f"parameter {name!r} of shape {plan.shape} has blocks with preconditioned dims "
        f"{big} > {LARGE_BLOCK_DIM}: each such factor is {max(big) ** 2 * 4 / 2**20:.0f} MiB "
        "in float32 and its inverse root takes seconds; lower "
        "blocking.max_preconditioner_dim or set blocking.skip_dim_size_gt."
    ]
