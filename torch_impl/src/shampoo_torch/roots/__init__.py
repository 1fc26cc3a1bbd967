"""Batched inverse roots of stacked factors (docs/spec.md eqs. 9-11d, 13, 17).

The same layout in every backend (reference, torch, JAX):

- :mod:`.regularize`: what every method shares, eqs. (9)-(10): symmetry,
  finiteness, eq. (9)'s epsilon (absolute, or relative to lambda_max: exact or
  eq. 9b's power iteration), eq. (10)'s epsilon rule on the eigenvalues, and
  eq. (10g)'s largest eigenvalues.
- :mod:`.eigh`: eq. (10)'s root by eigendecomposition with eq. (10b)'s accuracy
  test, the pseudo-inverse's rank cutoff (eq. 10g), eq. (10c)'s low-rank
  eigenvalues (applied inside eq. 10's root, which :mod:`.sketch`'s folded
  spectrum, itself an eigh, cannot import back), eq. (11b)'s root in the
  storage dtype and eq. (17)'s eigenbasis.
- :mod:`.basis`: a stored eigenbasis: eq. (17b)'s fit test, eq. (17c)'s QR
  iteration, eqs. (10f), (10h)'s roots from it.
- :mod:`.newton`: eq. (11)'s coupled Newton iteration (with retries), eq.
  (11c)'s higher-order iteration, eq. (11d)'s deflated Newton root.
- :mod:`.lobpcg`: the top-k eigenpairs eq. (11d) deflates.
- :mod:`.sketch`: eqs. (10d), (10e)'s sketched roots.
- :mod:`.dispatch`: the one place that reads the config and picks the method
  for a stack of factors.

Every function takes a stack ``[B, n, n]`` of (bias-corrected, eq. 7)
factors and returns the new inverse roots ``A^(-1/root)`` (or eigenbases)
together with a per-row ``ok`` mask (False: non-finite, eq. 11's Newton
failure, or eq. 10b's eigh error at ``EighConfig.failure_threshold``); the caller
(:func:`shampoo_torch.preconditioner.refresh_inverse_roots`) keeps the
previous inverse root wherever ``ok`` is False (eq. 13). ``root`` arguments
are the exponents r of eq. (12). Rows with
non-finite entries are replaced by the identity before any decomposition so
that one bad factor never poisons (or aborts) the batch.

Host syncs: none for the eigendecomposition path on CPU; ``torch.linalg.eigh``
itself checks convergence on CUDA (root steps only, amortized). The coupled
Newton iteration (eq. 11) stops when every row has converged; it asks the
device whether any row is still running every ``check_interval`` iterations
(1 on CPU, where it is free); the results do not depend on that interval
because finished rows are frozen. Eq. (11d)'s LOBPCG reads which rows still
run once per iteration (at most m per root step).
"""

from .basis import basis_still_fits
from .dispatch import (
    compute_inverse_root,
    root_inverse_in_storage_dtype,
    sketch_root,
    starts_from_basis,
)
from .regularize import finite_rows, largest_eigenvalues

__all__ = [
    "basis_still_fits",
    "compute_inverse_root",
    "finite_rows",
    "largest_eigenvalues",
    "root_inverse_in_storage_dtype",
    "sketch_root",
    "starts_from_basis",
]
