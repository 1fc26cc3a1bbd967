"""The registry of backends: every backend by name (the backend contract, :mod:`.protocol`).

Our backends are named (``"reference"``, ``"torch"``, ``"jax"``,
``"torch-ddp"``, ``"torch-fsdp2"``, ``"jax-sharded"``); the real third-party
libraries too (``"meta"``, ``"google"``: see
:mod:`shampoo_conformance.thirdparty.registry`); any other backend is named
``"package.module:factory"``, where ``factory()`` returns such an object,
so anyone can test their own Shampoo without editing this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis.strategies import SearchStrategy

from shampoo_conformance.adapters.reference import ReferenceBackend
from shampoo_conformance.protocol import Backend, BackendBase, Params, StepperFactory
from shampoo_conformance.thirdparty.registry import THIRD_PARTY, Deviation, ThirdParty
from shampoo_spec import BackendUnavailable, ShampooConfig, StepperUnavailable

#: The registry's hooks for a user's run of the library (thirdparty/registry.py).
USER_RUN_HOOKS = ("USER_KWARGS", "defaults_config", "library_run")


class FrameworkBackend(BackendBase):
    """A backend reached through an adapter module's numpy-in/numpy-out ``run``.

    The adapters (``shampoo_conformance.adapters.torch``, ``.torch_ddp``,
    ``.jax``, ``.jax_sharded``) take the arguments of the backend contract and run on
    the CPU in the requested dtype; importing one fails when its framework
    is missing, which is reported as :class:`BackendUnavailable`.
    """

    def __init__(self, name: str, module: str, install: str | None = None) -> None:
        self.name = name
        try:
            self._module = importlib.import_module(module)
        except ImportError as err:
            how = install or f"`pip install -e {name.split('-')[0]}_impl`"
            raise BackendUnavailable(
                f"backend {name!r} is not installed ({module}: {err}); install it with {how}."
            ) from err
        # The user-run hooks of thirdparty/registry.py (USER_KWARGS, defaults_config,
        # library_run), where the adapter has them: the suite's side-effect and
        # defaults properties skip, saying so, on a backend without them.
        for hook in USER_RUN_HOOKS:
            if hasattr(self._module, hook):
                setattr(self, hook, getattr(self._module, hook))

    def _run(self, config: ShampooConfig, params: Params, grads: list[Params],
             dtype: Any) -> list[Params]:
        out: list[Params] = self._module.run(config, params, grads, dtype=dtype)
        return out

    def _stepper_factory(self, dtype: Any) -> StepperFactory:
        """The package's ``stepper`` (raises :class:`StepperUnavailable` when it has none)."""
        make: StepperFactory | None = getattr(self._module, "stepper", None)
        if make is None:
            raise StepperUnavailable(
                f"backend {self.name!r} has no stepper ({self._module.__name__}.stepper): "
                "it runs open-loop only."
            )
        return make


class ThirdPartyBackend(FrameworkBackend):
    """A real library run from our exporters' kwargs (:mod:`.thirdparty.registry`).

    Besides ``run`` it states its capabilities: ``dtypes``, ``expressible``,
    ``configs()`` (the configs its library expresses, for the suite's random
    properties) and ``deviations`` (the documented differences from the spec).
    """

    def __init__(self, entry: ThirdParty) -> None:
        super().__init__(entry.name, entry.module, install=entry.install)
        self.library = entry.library
        self.dtypes: tuple[Any, ...] = tuple(self._module.dtypes)
        self.deviations: tuple[Deviation, ...] = tuple(self._module.DEVIATIONS)
        self.cases: dict[str, ShampooConfig] = dict(self._module.CASES)

    def expressible(self, config: ShampooConfig, dtype: Any = np.float64) -> str | None:
        """Why the library cannot run ``config`` in ``dtype``, or None when it can."""
        reason: str | None = self._module.expressible(config, dtype)
        return reason

    def base_config(self) -> ShampooConfig:
        """The library's config nearest ``ShampooConfig()`` (where fixed laws start)."""
        config: ShampooConfig = self._module.base_config()
        return config

    def configs(self) -> SearchStrategy[ShampooConfig]:
        """The configs the library expresses (its own arguments, imported)."""
        strategy: SearchStrategy[ShampooConfig] = self._module.configs()
        return strategy


def has_stepper(backend: object) -> bool:
    """Whether ``backend`` can train closed-loop (has a usable ``stepper``)."""
    if isinstance(backend, FrameworkBackend):
        return callable(getattr(backend._module, "stepper", None))
    return callable(getattr(backend, "stepper", None))


def _reference() -> Backend:
    return ReferenceBackend()


_BUILTIN: dict[str, Callable[[], Backend]] = {
    "reference": _reference,
    "torch": lambda: FrameworkBackend("torch", "shampoo_conformance.adapters.torch"),
    "jax": lambda: FrameworkBackend("jax", "shampoo_conformance.adapters.jax"),
    # Two gloo processes on CPU: rank 0's parameters.
    "torch-ddp": lambda: FrameworkBackend("torch-ddp", "shampoo_conformance.adapters.torch_ddp"),
    # The same two processes, parameters as FSDP2 DTensors (shard_mode="lossless").
    "torch-fsdp2": lambda: FrameworkBackend(
        "torch-fsdp2", "shampoo_conformance.adapters.torch_fsdp2"
    ),
    # Four host devices in a subprocess (the XLA flag must precede jax's start).
    "jax-sharded": lambda: FrameworkBackend(
        "jax-sharded", "shampoo_conformance.adapters.jax_sharded"
    ),
}


def available_backends() -> list[str]:
    """Names of our own backends (their frameworks may still be missing): ``all``."""
    return sorted(_BUILTIN)


def third_party_backends() -> list[str]:
    """Names of the backends that run another library (which may not be installed)."""
    return sorted(THIRD_PARTY)


def known_backends() -> list[str]:
    """Every backend :func:`get_backend` knows by name: ours, then the third-party ones."""
    return available_backends() + third_party_backends()


def get_backend(name: str) -> Backend:
    """A built-in backend by name, or a third-party one as ``package.module:factory``.

    Raises ``ValueError`` for an unknown name (listing the valid ones) and
    :class:`BackendUnavailable` when the backend's framework is not installed.
    """
    if not isinstance(name, str):
        raise ValueError(f"backend name = {name!r} is invalid: allowed a string.")
    if name in _BUILTIN:
        return _BUILTIN[name]()
    if name in THIRD_PARTY:
        return ThirdPartyBackend(THIRD_PARTY[name])
    if name.startswith("mutant:"):
        from shampoo_conformance.suite.mutants import mutant_backend

        return mutant_backend(name.removeprefix("mutant:"))
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise BackendUnavailable(
                f"backend {name!r}: cannot import {module_name!r}: {err}"
            ) from err
        factory = getattr(module, attr, None)
        if factory is None or not callable(factory):
            raise ValueError(f"backend {name!r}: {module_name!r} has no callable {attr!r}.")
        backend = factory()
        if not callable(getattr(backend, "run", None)):
            raise ValueError(f"backend {name!r}: factory returned an object without run().")
        return backend  # type: ignore[no-any-return]
    raise ValueError(
        f"backend = {name!r} is invalid: allowed one of {known_backends()}, "
        "'mutant:NAME' or 'package.module:factory'."
    )
