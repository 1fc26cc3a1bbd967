"""shampoo_jax: Shampoo (docs/spec.md) as an optax GradientTransformation.

>>> import optax, shampoo_jax, shampoo_spec
>>> opt = shampoo_jax.shampoo(shampoo_spec.ShampooConfig(learning_rate=0.1))
>>> state = opt.init(params)
>>> updates, state = opt.update(grads, state, params)
>>> params = optax.apply_updates(params, updates)

Modules, in the order of a step: :mod:`transform` (the optax
transformation: the step's phases in order), :mod:`state` (the state pytree,
its init and the dtype rules), :mod:`schedule` (eq. 8 on a traced step),
:mod:`blocks` (static layout of block groups, stacking, contractions, the
merged leaves of eq. 4), :mod:`elementwise` (the elementwise phases: inputs
and L2 decay, eq. 6c's gradient sum, the filter, momentum and the update,
eqs. 2, 15, 16b, 19-22), :mod:`refusal` (eq. 3 in jit: refused blocks),
:mod:`grafting` (eq. 14 and eq. 18's rescale; eq. 14e's Adafactor moments,
:class:`FactoredMoments`), :mod:`preconditioner` (the per-block maths, eqs.
6, 16-18), :mod:`refresh` (the root step on the block state, eqs. 7-13),
:mod:`roots` (inverse roots, eqs. 9-13: ``regularize``, ``eigh``, ``basis``,
``newton``, ``lobpcg``, ``sketch``, ``dispatch``), :mod:`eigenvalue_correction`
(eq. 17), :mod:`averaging` (iterate averaging, eq. 20d, and
:func:`averaged_params`, the parameters to evaluate at), :mod:`checks`
(argument checks and :func:`check_state`, on the host), :mod:`placement`
(:class:`ShardingConfig` and which device holds which block), :mod:`sharded`
(block state and inverse roots sharded over a mesh axis:
``shampoo(config, sharding=ShardingConfig(mesh, axis))``),
:mod:`checkpoint` (the state as NumPy arrays, config checked on load),
:mod:`restore_check` (:func:`checkpoint_metadata` and :func:`check_restored`:
the config check of a restore through a pytree checkpointer such as Orbax,
sharded or not). Its benchmarks live in ``shampoo_conformance.bench``
(``jax_step``, ``jax_sharded``). The conformance adapters (the backend contract) live in
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
from .restore_check import check_restored, checkpoint_metadata
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
    "check_restored",
    "check_state",
    "checkpoint_metadata",
    "config_array",
    "shampoo",
    "shard_state",
    "sharded_state_from_arrays",
    "sharded_state_to_arrays",
    "state_from_arrays",
    "state_to_arrays",
    "unshard_state",
]
