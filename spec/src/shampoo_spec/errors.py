"""Every exception the project defines, in one place (docs/spec.md eqs. 3, 13).

Backends re-export them (``shampoo_reference.NonFiniteGradientError is
shampoo_torch.NonFiniteGradientError``), so one ``except`` clause catches a
failure whatever framework raised it. Invalid configurations raise the
built-in ``ValueError`` (naming the field, the value and what is allowed);
nothing here replaces that.
"""

from __future__ import annotations


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or inf and ``failure.nonfinite_gradient = "raise"`` (eq. 3)."""


class RootFailureError(FloatingPointError):
    """A block's inverse roots failed more root steps in a row than allowed (eq. 13)."""


class BackendUnavailable(RuntimeError):
    """A conformance backend's framework or library is not installed (the backend contract).

    The suite and the report show such a backend as skipped, never as failed.
    """


class Inexpressible(ValueError):
    """A config that another library's arguments cannot express (the importer contract).

    Raised by ``to_meta`` / ``to_google`` naming every field the library has
    no argument for, and by a third-party conformance backend asked to run
    such a config: the suite reports it as skipped with this reason, never
    as passed. A ``ValueError``, so code that catches invalid configs still
    catches it.
    """


class StepperUnavailable(NotImplementedError):
    """A conformance backend runs open-loop only (``run``); it has no ``stepper``."""


__all__ = [
    "BackendUnavailable",
    "Inexpressible",
    "NonFiniteGradientError",
    "RootFailureError",
    "StepperUnavailable",
]
