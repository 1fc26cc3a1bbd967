"""A SOAP library as a conformance backend: what the two SOAP adapters share.

:mod:`.pytorch_optimizer_soap` and :mod:`.heavyball_soap` differ in their
``from_kwargs`` (each library's defaults and refusals), the arguments they
always pass (``library_kwargs``), their constructor and the kwargs their
property tests draw; the functions a third-party adapter exposes
(:mod:`.registry`: ``expressible``, ``configs``, ``base_config``, ``run``,
``stepper``) are the same rules around those, written once here as the
methods of :class:`SoapBackend`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.thirdparty.soap import common_kwargs, refuse_differences
from shampoo_conformance.thirdparty.torch_library import in_dtype, make_stepper, run_optimizer
from shampoo_spec import Inexpressible, ShampooConfig


@dataclass(frozen=True)
class SoapBackend:
    """One SOAP library's backend functions.

    ``from_kwargs``: the config the library runs for its keyword arguments;
    ``library_kwargs(config)``: the arguments this backend always passes
    besides :func:`.soap.common_kwargs`; ``construct(tensors, kwargs, dtype)``:
    the library's optimizer; ``draw_kwargs()``: a strategy of the library's
    kwargs for the suite's random properties.
    """

    name: str
    from_kwargs: Callable[[dict[str, Any]], ShampooConfig]
    library_kwargs: Callable[[ShampooConfig], dict[str, Any]]
    construct: Callable[[list[torch.nn.Parameter], dict[str, Any], Any], torch.optim.Optimizer]
    draw_kwargs: Callable[[], st.SearchStrategy[dict[str, Any]]]

    def soap_kwargs(self, config: ShampooConfig) -> dict[str, Any]:
        """The library's keyword arguments for ``config`` (params aside); raises
        :class:`Inexpressible` naming every field they cannot say."""
        kwargs = {**common_kwargs(config, self.name), **self.library_kwargs(config)}
        nearest = self.from_kwargs(kwargs)
        refuse_differences(self.name, in_dtype(config, np.float64), nearest)
        return kwargs

    def expressible(self, config: ShampooConfig, dtype: Any = np.float64) -> str | None:
        """Why the library cannot run ``config`` in ``dtype``, or None if it can."""
        try:
            self.soap_kwargs(in_dtype(config, np.float64))
        except Inexpressible as err:
            return str(err)
        return None

    def configs(self) -> st.SearchStrategy[ShampooConfig]:
        """Configs the library expresses: its own kwargs, mapped by ``from_kwargs``."""
        return self.draw_kwargs().map(self.from_kwargs)

    def base_config(self) -> ShampooConfig:
        """Its defaults nearest ``ShampooConfig()``: lr 0.01, no weight decay, a new basis
        every step, nothing merged, no dim limit."""
        return self.from_kwargs({"lr": 0.01, "weight_decay": 0.0, "precondition_frequency": 1})

    def optimizer(self, config: ShampooConfig, tensors: list[torch.nn.Parameter],
                  dtype: Any) -> torch.optim.Optimizer:
        """The library's optimizer for ``config`` over ``tensors`` (refusing what it
        cannot express)."""
        reason = self.expressible(config, dtype)
        if reason is not None:
            raise Inexpressible(f"backend {self.name!r}: {reason}")
        return self.construct(tensors, self.soap_kwargs(in_dtype(config, np.float64)), dtype)

    def run(
        self,
        config: ShampooConfig,
        params: dict[str, np.ndarray],
        grads: list[dict[str, np.ndarray]],
        dtype: Any = np.float64,
    ) -> list[dict[str, np.ndarray]]:
        """The parameters (as ``dtype`` arrays) after each step of ``grads``."""
        return run_optimizer(self.name, self.optimizer, config, params, grads, dtype)

    def stepper(
        self,
        optimizer: str,
        params: dict[str, np.ndarray],
        *,
        lr: float,
        config: ShampooConfig | None = None,
        weight_decay: float = 0.0,
        dtype: Any = np.float64,
    ) -> Stepper:
        """A closed-loop :class:`~shampoo_conformance.adapters.torch.Stepper`: the library's
        SOAP from ``config`` (default :meth:`base_config`) with learning rate ``lr``, or
        ``torch.optim.AdamW`` (as the torch backend's)."""
        return make_stepper(self.name, self.optimizer, optimizer, params, lr, config,
                            weight_decay, self.base_config(), dtype)
