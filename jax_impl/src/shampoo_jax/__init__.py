"""shampoo_jax: Shampoo (docs/spec.md) as an optax GradientTransformation.

>>> import optax, shampoo_jax, shampoo_spec
>>> opt = shampoo_jax.shampoo(shampoo_spec.ShampooConfig(learning_rate=0.1))
>>> state = opt.init(params)
>>> updates, state = opt.update(grads, state, params)
>>> params = optax.apply_updates(params, updates)

Modules: :mod:`schedule` (eq. 8 on a traced step), :mod:`blocks` (static
layout, stacking, contractions), :mod:`roots` (eqs. 9-13), :mod:`grafting`
(eq. 14), :mod:`transform` (the step), :mod:`checkpoint`, :mod:`testing`
(contract 8.2), :mod:`bench` (``python -m shampoo_jax.bench``), :mod:`sharded`
(block state and roots sharded over a mesh axis: ``shampoo(config,
sharding=ShardingConfig(mesh, axis))``), :mod:`testing_sharded` (contract 8.2
on four host devices), :mod:`bench_sharded`.
"""

from .checkpoint import (
    sharded_state_from_arrays,
    sharded_state_to_arrays,
    state_from_arrays,
    state_to_arrays,
)
from .sharded import ShardingConfig, shard_state, unshard_state
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
    "ShardingConfig",
    "check_state",
    "shampoo",
    "shard_state",
    "sharded_state_from_arrays",
    "sharded_state_to_arrays",
    "state_from_arrays",
    "state_to_arrays",
    "unshard_state",
]
