"""shampoo_jax: Shampoo (docs/spec.md) as an optax GradientTransformation.

>>> import optax, shampoo_jax, shampoo_spec
>>> opt = shampoo_jax.shampoo(shampoo_spec.ShampooConfig(learning_rate=0.1))
>>> state = opt.init(params)
>>> updates, state = opt.update(grads, state, params)
>>> params = optax.apply_updates(params, updates)

Modules: :mod:`state` (the state pytree and its init), :mod:`schedule`
(eq. 8 on a traced step), :mod:`blocks` (static layout of block groups,
stacking, contractions), :mod:`roots` (inverse roots, eqs. 9-13),
:mod:`grafting` (eq. 14; eq. 14e's Adafactor moments,
:class:`FactoredMoments`), :mod:`preconditioner` (the per-block maths, eqs.
6-13 and 16-18), :mod:`averaging` (iterate averaging, eq. 20d, and
:func:`averaged_params`, the parameters to evaluate at),
:mod:`refusal` (eq. 3 in jit: refused blocks),
:mod:`checks` (argument checks and :func:`check_state`, on the host),
:mod:`transform` (the optax transformation: the step's phases in order),
:mod:`sharded` (block state and inverse roots sharded over a mesh axis:
``shampoo(config, sharding=ShardingConfig(mesh, axis))``),
:mod:`checkpoint`, :mod:`bench` (``python -m shampoo_jax.bench``),
:mod:`bench_sharded`. The conformance adapters (contract 8.2) live in
``shampoo_conformance.adapters.jax`` and ``.jax_sharded``; this package never
imports them.
"""

from shampoo_spec import NonFiniteGradientError, RootFailureError

from .averaging import averaged_params
from .checkpoint import (
    config_array,
    sharded_state_from_arrays,
    sharded_state_to_arrays,
    state_from_arrays,
    state_to_arrays,
)
from .checks import check_state
from .grafting import FactoredMoments
from .placement import ShardingConfig
from .sharded import shard_state, unshard_state
from .state import BlockGroupState, ParameterInfo, ShampooState
from .transform import shampoo

__all__ = [
    "BlockGroupState",
    "FactoredMoments",
    "NonFiniteGradientError",
    "ParameterInfo",
    "RootFailureError",
    "ShampooState",
    "ShardingConfig",
    "averaged_params",
    "check_state",
    "config_array",
    "shampoo",
    "shard_state",
    "sharded_state_from_arrays",
    "sharded_state_to_arrays",
    "state_from_arrays",
    "state_to_arrays",
    "unshard_state",
]
