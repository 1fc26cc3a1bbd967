"""The reference, recording eq. (17b)'s decisions, for the backends' basis-reuse tests.

torch and JAX are compared with the reference on streams where the stored
eigenbasis is kept on some root steps and recomputed on others; the
comparison means something only where both happen, which
:class:`CountingReference` lets a test check.
"""

from __future__ import annotations

from typing import Any

from shampoo_reference import ReferenceShampoo


class CountingReference(ReferenceShampoo):
    """The reference, counting eq. (17b)'s decisions: ``decisions[i]`` is True where
    the i-th stored eigenbasis was kept, False where it was recomputed."""

    decisions: list[bool]

    def _basis_still_fits(self, basis: Any, a: Any) -> bool:
        fits: bool = super()._basis_still_fits(basis, a)
        if basis is not None:
            self.decisions = [*getattr(self, "decisions", []), fits]
        return fits
