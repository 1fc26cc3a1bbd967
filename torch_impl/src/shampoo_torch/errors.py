"""Errors raised by the failure policy (docs/spec.md eqs. 3 and 13)."""

from __future__ import annotations


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or inf and ``failure.nonfinite_gradient = "raise"`` (eq. 3)."""


class RootFailureError(FloatingPointError):
    """A block's inverse roots failed more root steps in a row than allowed (eq. 13)."""
