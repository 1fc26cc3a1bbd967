"""Inverse roots of the factors, eqs. (9)-(13) and (17) of docs/spec.md, in float64.

- :mod:`.regularize`: what every method shares: symmetry, the effective
  epsilon of eq. (9) (absolute, or relative to lambda_max: exact or the power
  iteration of eq. 9b) and how it meets the eigenvalues, eq. (10).
- :mod:`.eigh`: eq. (10) by eigendecomposition, its error (eq. 10b) and
  failure test, the pseudo-inverse rank cutoff, the root in the storage dtype
  (eq. 11b), and eq. (17)'s eigenbasis.
- :mod:`.basis`: a stored eigenbasis: its off-diagonal test (eqs. 17b, 10h)
  and Meta's QR iteration from it (eqs. 17c, 10f).
- :mod:`.newton`: the Newton family: coupled (eq. 11, with retries),
  deflated by LOBPCG's top-k pairs (eq. 11d) and higher order (eq. 11c).
- :mod:`.lobpcg`: the top-k eigenpairs of eq. (11d), as Google computes them.
- :mod:`.sketch`: compressed roots: low rank (eq. 10c), frequent directions
  (eq. 10d) and tearfree's Sketchy (eq. 10e).
- :mod:`.dispatch`: the one place that reads the config and picks the method
  for a factor.

Everything is exact up to float64 rounding except the Newton family, which
is iterative by design (it is the method being specified, with its stopping
rule).
"""

from .dispatch import (
    eigenbasis_still_fits,
    inverse_root,
    qr_basis,
    sketch_root,
    stored_basis_root,
    stored_root_dtype,
)
from .eigh import (
    EighResult,
    eigenbasis_with_error,
    eigh_error,
    eigh_fails,
    root_inverse_eigh,
    root_inverse_eigh_with_error,
)
from .newton import coupled_newton_iteration, root_inverse_coupled_newton
from .regularize import symmetrize
from .sketch import Sketch

__all__ = [
    "EighResult",
    "Sketch",
    "coupled_newton_iteration",
    "eigenbasis_still_fits",
    "eigenbasis_with_error",
    "eigh_error",
    "eigh_fails",
    "inverse_root",
    "qr_basis",
    "root_inverse_coupled_newton",
    "root_inverse_eigh",
    "root_inverse_eigh_with_error",
    "sketch_root",
    "stored_basis_root",
    "stored_root_dtype",
    "symmetrize",
]
