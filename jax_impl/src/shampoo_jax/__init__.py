"""shampoo_jax: Shampoo (docs/spec.md) as an optax GradientTransformation.

>>> import optax, shampoo_jax, shampoo_spec
>>> opt = shampoo_jax.shampoo(shampoo_spec.ShampooConfig(learning_rate=0.1))
>>> state = opt.init(params)
>>> updates, state = opt.update(grads, state, params)
>>> params = optax.apply_updates(params, updates)

Modules: :mod:`schedule` (eq. 8 on a traced step), :mod:`blocks` (static
layout, stacking, contractions), :mod:`roots` (eqs. 9-13), :mod:`grafting`
(eq. 14), :mod:`transform` (the step), :mod:`checkpoint`, :mod:`testing`
(contract 8.2), :mod:`bench` (``python -m shampoo_jax.bench``).
"""

from .checkpoint import state_from_arrays, state_to_arrays
from .transform import (
    BlockGroupState,
    NonFiniteGradientError,
    RootFailureError,
    ShampooState,
    check_state,
    shampoo,
)

__all__ = [
    "BlockGroupState",
    "NonFiniteGradientError",
    "RootFailureError",
    "ShampooState",
    "check_state",
    "shampoo",
    "state_from_arrays",
    "state_to_arrays",
]
