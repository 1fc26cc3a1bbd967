"""Each backend at its own defaults: the report's first verdict (what a user gets who
changes nothing).

For every backend with the registry's user-run hooks (thirdparty/registry.py:
``USER_KWARGS``, ``defaults_config``, ``library_run``) the report runs the suite's
six user-run checks (:data:`shampoo_conformance.suite.user_runs.CHECKS`): the
library at ``USER_KWARGS`` against the reference on ``defaults_config()`` in
float64 and float32 (docs/spec.md eq. 2, within the bound of section 5), and the
side-effect properties (the caller's gradients, an unknown argument, the global
random generators, float64 parameters). Each check's outcome is kept as the suite
would judge it: passed, failed with what happened (and the documented deviation
that explains it, if one does), or not checkable with the reason (a bound that
promises nothing, a dtype the library does not run, defaults no config of the
spec expresses). A check that raises something else is a failure with the
exception's name: the report goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from shampoo_conformance.protocol import Backend
from shampoo_conformance.suite.user_runs import CHECKS
from shampoo_conformance.thirdparty.registry import deviation_for
from shampoo_spec import Inexpressible

#: Short names of the checks for the report's table.
CHECK_NAMES: dict[str, str] = {
    "test_library_defaults_float64": "exact f64",
    "test_library_defaults_float32": "exact f32",
    "test_side_effect_grads_unchanged": "grads kept",
    "test_side_effect_unknown_argument_refused": "refuses typos",
    "test_side_effect_global_rng_unchanged": "RNG kept",
    "test_side_effect_float64_stays_float64": "stays f64",
}


@dataclass(frozen=True)
class CheckOutcome:
    """One check on one backend: ``status`` "pass", "fail" or "n/a"; ``detail`` what
    happened (first line of the failure or skip); ``deviation`` the documented
    deviation that covers a failure ("name (kind)"), empty when none does."""

    check: str
    status: str
    detail: str = ""
    deviation: str = ""


@dataclass(frozen=True)
class DefaultsVerdict:
    """A backend at its defaults: the arguments a user must give and each check."""

    backend: str
    user_kwargs: str
    outcomes: tuple[CheckOutcome, ...]
    note: str = ""  # why nothing ran (no hooks)

    @property
    def undocumented(self) -> list[CheckOutcome]:
        """Failures no documented deviation explains (a defect of the suite's account)."""
        return [o for o in self.outcomes if o.status == "fail" and not o.deviation]

    def summary(self) -> str:
        """One line: what a user who changes nothing gets."""
        if self.note:
            return self.note
        failed = [o for o in self.outcomes if o.status == "fail"]
        if not failed:
            unchecked = [CHECK_NAMES[o.check] for o in self.outcomes if o.status == "n/a"]
            return ("no difference found" if not unchecked
                    else "no difference found (not checkable: " + ", ".join(unchecked) + ")")
        return "; ".join(f"{CHECK_NAMES[o.check]}: "
                         + (o.deviation or "UNDOCUMENTED: " + o.detail) for o in failed)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _short(value: Any) -> str:
    """A user argument as the table shows it: a number or string as written, an object
    by its type (``ShampooConfig(...)``)."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    return f"{type(value).__name__}(...)"


def defaults_verdict(backend: Backend) -> DefaultsVerdict:
    """Run every user-run check on ``backend`` (module docstring)."""
    kwargs: Any = getattr(backend, "USER_KWARGS", None)
    if kwargs is None or getattr(backend, "library_run", None) is None:
        return DefaultsVerdict(backend.name, "-", (), note="no user-run hooks (not probed)")
    deviations = tuple(getattr(backend, "deviations", ()))
    outcomes = []
    for test_id, check in CHECKS.items():
        try:
            check(backend)
        except pytest.skip.Exception as skip:
            outcomes.append(CheckOutcome(test_id, "n/a", _first_line(skip)))
        except Inexpressible as err:  # the suite skips these too (its pytest plugin)
            outcomes.append(CheckOutcome(test_id, "n/a", "no config of the spec: "
                                         + _first_line(err)))
        except Exception as err:  # noqa: BLE001  (a failed check, or a crash outside it)
            found = deviation_for(deviations, test_id)
            detail = _first_line(err)
            if not isinstance(err, AssertionError):
                detail = f"{type(err).__name__}: {detail}"
            outcomes.append(CheckOutcome(test_id, "fail", detail,
                                         f"{found.name} ({found.kind})" if found else ""))
        else:
            outcomes.append(CheckOutcome(test_id, "pass"))
    shown = ", ".join(f"{k}={_short(v)}" for k, v in dict(kwargs).items()) or "(none)"
    return DefaultsVerdict(backend.name, shown, tuple(outcomes))
