"""Batched inverse roots of Kronecker factors, eqs. (9)-(13), (17).

Every function takes a stack of matrices ``a`` of shape ``[b, n, n]`` and
returns per-matrix results plus a per-matrix ``ok`` flag, so one failed
matrix never affects its neighbours and nothing branches in Python on a
traced value. The rules are those of ``shampoo_reference``'s roots, in the
same modules:

- :mod:`.regularize`: what every method shares: eq. (9)'s
  :func:`effective_epsilon` (exact lambda_max, or eq. 9b's power iteration),
  eq. (10)'s epsilon placements, the eigendecomposition of a stack (on CPU
  one matrix at a time), ``round_s`` of eqs. (11a), (16);
- :mod:`.eigh`: eq. (10) by eigendecomposition (:func:`root_inverse_eigh`),
  with eq. (10b)'s error test; eq. (11b)'s root of factors stored in 16 bits;
  eq. (17)'s :func:`eigenbasis`; eq. (10g)'s two halves
  (:func:`eigh_for_parameter_cutoff`, :func:`root_at_cutoff`);
- :mod:`.basis`: a stored eigenbasis: eq. (17b)'s :func:`basis_still_fits`,
  eq. (17c)'s QR steps (:func:`qr_eigenbasis`), eq. (10f)'s
  :func:`root_inverse_qr`, eq. (10h)'s :func:`root_inverse_reusing_basis`;
- :mod:`.newton`: eq. (11)'s :func:`root_inverse_coupled_newton` (with its
  retries), eq. (11c)'s :func:`root_inverse_higher_order`, eq. (11d)'s
  :func:`root_inverse_deflated_newton`;
- :mod:`.lobpcg`: the top-k eigenpairs eq. (11d) deflates;
- :mod:`.sketch`: compressed roots: eq. (10c)'s low rank, eq. (10d)'s
  frequent directions (:class:`Sketch`, :func:`frequent_directions_root`),
  eq. (10e)'s :func:`tearfree_sketch_root`;
- :mod:`.dispatch`: :func:`compute_inverse_root`, one stack by the
  configured method; a failed or non-finite inverse root is reported
  (eq. 13) so that the caller keeps the previous one.

``root`` is always the exponent r of eq. (12); the matrices ``A^(-1/r)``
(or eigenbases) are inverse roots.
"""

from .basis import basis_still_fits, qr_eigenbasis, root_inverse_qr, root_inverse_reusing_basis
from .dispatch import compute_inverse_root
from .eigh import (
    cut_eigenvalues,
    eigenbasis,
    eigh_error,
    eigh_for_parameter_cutoff,
    eigh_passes,
    root_at_cutoff,
    root_inverse_eigh,
)
from .newton import (
    matrix_power,
    root_inverse_coupled_newton,
    root_inverse_deflated_newton,
    root_inverse_higher_order,
)
from .regularize import all_finite, effective_epsilon, rounded, symmetrize
from .sketch import (
    Sketch,
    frequent_directions_root,
    select_sketch,
    sketch_epsilon,
    tearfree_sketch_root,
)

__all__ = [
    "Sketch",
    "all_finite",
    "basis_still_fits",
    "compute_inverse_root",
    "cut_eigenvalues",
    "effective_epsilon",
    "eigenbasis",
    "eigh_error",
    "eigh_for_parameter_cutoff",
    "eigh_passes",
    "frequent_directions_root",
    "matrix_power",
    "qr_eigenbasis",
    "root_at_cutoff",
    "root_inverse_coupled_newton",
    "root_inverse_deflated_newton",
    "root_inverse_eigh",
    "root_inverse_higher_order",
    "root_inverse_qr",
    "root_inverse_reusing_basis",
    "rounded",
    "select_sketch",
    "sketch_epsilon",
    "symmetrize",
    "tearfree_sketch_root",
]
