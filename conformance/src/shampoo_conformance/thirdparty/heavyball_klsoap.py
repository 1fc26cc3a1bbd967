"""The ``heavyball-klsoap`` backend: heavyball 3.2.1's ``KLSOAP``, which no config expresses.

``heavyball.KLSOAP`` (heavyball/__init__.py:912-932) is heavyball's SOAP
(:mod:`.heavyball_soap`: Adam's moments in the factors' eigenbases, eq. 17)
with one change, ``scale_by_kl_soap`` (heavyball/chainable.py:1322-1339): the
factors of a matrix take KL-Shampoo's statistics (``update_ggt_kl``,
heavyball/utils.py:1273-1303, :mod:`.heavyball_kl`'s docstring)

    GG_L <- lerp(GG_L, G Q_R diag(1 / max(d_R, eps)) Q_R^T G^T / n, w_t)
    d_R = diag(Q_R^T GG_R Q_R)

and the same for GG_R; every other parameter (vectors, tensors of order >= 3)
takes SOAP's plain outer products, so KLSOAP equals SOAP there bit for bit
(conformance/tests/test_adapter_heavyball_kl.py shows both).

The spec has no config for it: eq. (6b) preconditions the statistics by the
inverse roots X_j of eq. (10), which eq. (17) does not compute, and the
config validation refuses ``statistics.kl`` with ``eigenvalue_correction``
(:data:`~.heavyball_kl.KLSOAP_REFUSAL`). :func:`expressible` refuses every
config with that reason, so :func:`run` raises
:class:`~shampoo_spec.Inexpressible` and the suite's comparisons skip; the
user-run hooks (``USER_KWARGS``, ``library_run``) still run the library, and
:func:`defaults_config` is the nearest config, SOAP's statistics in place of
KL's (``kl_statistics``).
"""

from __future__ import annotations

from typing import Any

import heavyball
import numpy as np
import torch
from hypothesis import strategies as st

from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty import heavyball_kl as kl
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_conformance.thirdparty.soap import NO_DIM_LIMIT, soap_config
from shampoo_spec import Inexpressible, ShampooConfig
from shampoo_spec.config import EpsilonConfig

#: Parameter dtypes the library runs (for the user-run hooks; no config runs).
dtypes = (np.float64, np.float32)

BACKEND = "heavyball-klsoap"

#: What a user must pass besides the parameters: nothing (every argument has a default).
USER_KWARGS: dict[str, Any] = {}

#: SOAP's QR ridge, as heavyball_soap's EPSILON (1e-8 times the largest Rayleigh quotient).
_EPSILON = EpsilonConfig(value=1e-8, scale="relative", placement="ridge", lambda_max="exact")


def nearest_config(kwargs: dict[str, Any]) -> ShampooConfig:
    """The config nearest ``heavyball.KLSOAP(**kwargs)``: heavyball's SOAP on the same
    arguments (:mod:`.heavyball_soap`'s mapping), plain statistics in place of KL's."""
    k = {**kl.SOAP_DEFAULTS, **kwargs}
    return soap_config(
        lr=k["lr"], betas=tuple(k["betas"]), shampoo_beta=k["shampoo_beta"], eps=k["eps"],
        weight_decay=k["weight_decay"], frequency=k["precondition_frequency"],
        precondition_1d=k["precondition_1d"], correct_bias=True, period_anchor="end",
        epsilon=_EPSILON, statistics_bias_correction=True)


def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why ``heavyball.KLSOAP`` cannot run ``config``: always
    :data:`.heavyball_kl.KLSOAP_REFUSAL`."""
    return kl.KLSOAP_REFUSAL


def configs() -> st.SearchStrategy[ShampooConfig]:
    """KLSOAP's kwargs mapped to their nearest config (SOAP's): every one is refused, so
    a property drawing them skips with :data:`.heavyball_kl.KLSOAP_REFUSAL`."""
    return st.builds(lambda lr, f: nearest_config({"lr": lr, "precondition_frequency": f}),
                     st.sampled_from([0.01, 0.1]), st.sampled_from([1, 2]))


def base_config() -> ShampooConfig:
    """The nearest config to its defaults at lr 0.01, no weight decay, bases every step
    (refused, as every config)."""
    return nearest_config({"lr": 0.01, "weight_decay": 0.0, "precondition_frequency": 1})


def defaults_config() -> ShampooConfig:
    """The config nearest ``heavyball.KLSOAP(params)``: SOAP at its defaults."""
    return nearest_config(dict(USER_KWARGS))


def run(config: ShampooConfig, params: dict[str, np.ndarray],
        grads: list[dict[str, np.ndarray]], dtype: Any = np.float64) -> list[dict[str, np.ndarray]]:
    """Raises :class:`Inexpressible` (no config is KLSOAP)."""
    raise Inexpressible(f"backend {BACKEND!r}: {kl.KLSOAP_REFUSAL}")


def stepper(optimizer_name: str, params: dict[str, np.ndarray], *, lr: float,
            config: ShampooConfig | None = None, weight_decay: float = 0.0,
            dtype: Any = np.float64) -> Stepper:
    """Raises :class:`Inexpressible` (no config is KLSOAP)."""
    raise Inexpressible(f"backend {BACKEND!r}: {kl.KLSOAP_REFUSAL}")


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any) -> LibraryRun:
    """A user's run: ``heavyball.KLSOAP(parameters, **kwargs)``, nothing added."""
    return torch_library_run(lambda ps, kw: heavyball.KLSOAP(ps, **kw),
                             kwargs, params, grads, dtype)


def construct(tensors: list[torch.nn.Parameter], kwargs: dict[str, Any],
              dtype: Any) -> heavyball.KLSOAP:
    """``heavyball.KLSOAP`` as the adapter tests run it: nothing merged, no dim limit,
    state in the parameters' dtype."""
    return heavyball.KLSOAP(tensors, **{"merge_dims": False, "max_precond_dim": NO_DIM_LIMIT,
                                        **kwargs}, storage_dtype=kl.float64_storage(dtype))


#: The defaults tests that fail: float64 (a crash, and the differences below); in float32
#: the bound of section 5 promises nothing on eq. (17) (the suite skips it).
_DEFAULTS_TESTS = ("test_library_defaults_float64",)

#: No config is KLSOAP: no named case runs.
CASES: dict[str, ShampooConfig] = {}

DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        name="kl_statistics",
        config=None,
        tests=_DEFAULTS_TESTS,
        cause=(f"a matrix's factors take KL statistics ({kl.CHAIN}:1339 -> "
               f"update_ggt_kl, {kl.UTILS}:1273-1303), which the spec cannot combine with "
               "eq. (17) (statistics.kl with eigenvalue_correction is refused); "
               "defaults_config() is SOAP's, the nearest"),
        kind="design",
    ),
    Deviation(
        name="first_step_skipped",
        config=None,
        tests=_DEFAULTS_TESTS,
        cause=(f"as SOAP: step 1 only builds the statistics and the first eigenbasis "
               f"(skip_first, {kl.CHAIN}:366-377); every trajectory differs from step 1 on"),
        kind="design",
    ),
    *kl.shared_deviations("KLSOAP", f"{kl.CHAIN}:1298 -> {kl.UTILS}:929", _DEFAULTS_TESTS),
)
