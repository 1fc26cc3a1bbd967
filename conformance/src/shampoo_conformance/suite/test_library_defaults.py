"""What a user who changes nothing gets: the library at ``USER_KWARGS`` equals the
reference running ``defaults_config()`` (thirdparty/registry.py).

The parameters after each step of eq. (2), W_t = W_{t-1} - lr U_t, within the
bound of docs/spec.md section 5 (suite/tolerances.py) at the precision the
library computes in (suite/user_runs.py: the coarser of the parameters' dtype
and the default ``factor_dtype``), on a few small problems, for enough steps that
the defaults' schedule (eq. 8) has started preconditioning. Every difference is a
deviation (the library's DEVIATIONS names it) or a bug of the adapter's
``defaults_config``.
"""

from __future__ import annotations

import numpy as np

from shampoo_conformance.protocol import Backend
from shampoo_conformance.suite import user_runs


def test_library_defaults_float64(backend: Backend) -> None:
    user_runs.check_defaults(backend, np.float64)


def test_library_defaults_float32(backend: Backend) -> None:
    user_runs.check_defaults(backend, np.float32)
