"""Save and restore a :class:`ShampooState` as plain NumPy arrays (no pickle).

``state_to_arrays`` flattens the state pytree to a list of NumPy arrays in
``jax.tree.flatten`` order; ``state_from_arrays`` puts them back into the
structure of a freshly initialised state (``opt.init(params)``). The round
trip is bit-identical, so training resumes exactly (tests/test_state.py).
Store the list with ``numpy.savez`` and load it with ``numpy.load``
(``allow_pickle=False``).

The arrays are positional (``jax.tree.flatten`` order of the NamedTuples'
fields), never keyed by field name, so renaming a field keeps old
checkpoints loadable: ``BlockGroupState.inverse_roots`` (called ``roots``
before) is still the second field of each block group, and checkpoints
written before the rename load unchanged (tests/test_state.py).

Sharded states (:mod:`shampoo_jax.sharded`) are saved in the single-device
layout: ``sharded_state_to_arrays`` drops the padding, so the arrays equal
those of the same state on one device, and ``sharded_state_from_arrays``
pads and places them for any device count. A state saved on N devices
resumes on N' (or on one device with ``state_from_arrays``) exactly.

The config: every state made by ``shampoo(config).init`` carries its config
(as JSON, in the static ``ShampooState.info``), and ``state_to_arrays``
always stores it, after the state's arrays and the format entry: a 0-d NumPy
string array (loadable with ``allow_pickle=False``; one per Shampoo state in
the pytree, in tree order, the last entries). ``state_from_arrays(arrays, like)`` compares it
with the config ``like`` was initialised under and raises ``ValueError``
naming every field that differs (``shampoo_spec.config_differences``), so
resuming under another config (a learning rate, a beta2, a block size)
never succeeds silently. To resume under a changed config on purpose,
replace the entry: ``arrays[-1] = config_array(new_config)``.

The optional ``config=`` arguments (kept for callers of the first version
of this API) must equal the config the state or ``like`` carries, and
stand in for it where a hand-built state carries none.

Checkpoints written before configs were stored (no config entry, and one
array fewer per Shampoo state: ``skipped_per_parameter`` did not exist yet)
load with a ``UserWarning`` (the config is not checked; the per-parameter
skip counters start at zero). Arrays with the current layout but no config
entry (the entry was dropped) are refused: ``state_to_arrays`` never
writes them.

After the state's arrays comes a format entry, a 0-d string array
(:data:`FORMAT`), then the config entries: the arrays must then have exactly
the current layout. Checkpoints written before the update guard (eq. 22)
existed have no format entry and one array fewer per Shampoo state
(``withheld_updates``): they load, that counter starting at zero; any other
count is refused.

Arrays keep the state's dtypes, the inverse roots in ``inverse_root_dtype``
(the eigenbases in ``eigenvectors_dtype``) and the corrected moment in
``corrected_eigenvalues_dtype`` when set (eqs. 11a, 17a); an array in another
dtype than the state's is
refused. A bfloat16 array comes back from ``numpy.load`` as raw 2-byte
voids (NumPy has no bfloat16): where the state needs bfloat16, such an
array is read as bfloat16, bytes unchanged.

With ``momentum.storage="int8_columnwise"`` (eq. 20b) the momentum leaves
of parameters of rank >= 2 are int8 arrays and their scales follow the other
fields (``ShampooState.momentum_scale``, ``graft_momentum_scale``, in
``momentum.scale_dtype``): saved as they are, loaded only in exactly those
dtypes (the config check, first, names a differing ``momentum.storage``).

A diagonal preconditioner's state V_D (eq. 16b, ``ShampooState.diagonal``)
is saved and restored as the graft state V is: its arrays follow the other
fields', so a state without it keeps today's layout. Likewise iterate
averaging's base sequence Z and Schedule-Free's ``S_t``
(eq. 20d, ``ShampooState.averaged`` and ``lr_power_sum``, the last two
fields): after V_D, absent (no arrays) without ``config.averaging``.

Frequent-directions sketches (eq. 10d, ``BlockGroupState.sketches``: U,
lambda and rho of each sketched factor, the last field of each block group)
and eq. (6c)'s gradient sum S (``ShampooState.gradient_sum``, the last
field, elementwise like V) are saved and restored likewise; a state
without ``frequent_directions`` holds neither, so its layout is unchanged.
A checkpoint taken between statistics steps keeps the partial sum: the run
resumes bit for bit (tests/test_frequent_directions.py).

Eq. (14e)'s Adafactor moments (``ShampooState.adafactor``, the last field:
per parameter R and C, or V, in tree order) are saved and restored likewise;
a state without the Adafactor graft holds none, so its layout is unchanged.
Sharded, they are saved whole (they take the parameters' placement, not the
blocks' padding) and placed again on restore.

Every float array must be finite: a NaN or inf anywhere in the arrays
raises ``ValueError`` naming the state field, before anything is built
(a finite state stays finite, so such a file is damaged).

"""

from __future__ import annotations

import json
import warnings
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from shampoo_spec import ShampooConfig, config_differences

from .placement import ShardingConfig
from .sharded import shard_state, unshard_state
from .state import ShampooState, config_json

# Fields added by the update guard (eq. 22): absent from older checkpoints.
_GUARD_FIELDS = ("withheld_updates",)
#: The format entry between the state's arrays and its config entries: the
#: layout is exactly the current one. Without it, a checkpoint with configs is
#: one written before the update guard (one array fewer per Shampoo state).
_FORMAT_PREFIX = "shampoo_jax.state_to_arrays/"
FORMAT = _FORMAT_PREFIX + "3"


def config_array(config: ShampooConfig) -> np.ndarray:
    """The config as a checkpoint entry: its JSON (``config.to_dict()``) in a 0-d string array."""
    return np.asarray(config_json(config))


def _is_shampoo_state(x: Any) -> bool:
    return isinstance(x, ShampooState)


def _shampoo_states(tree: Any) -> list[ShampooState]:
    """The :class:`ShampooState` nodes of a pytree (the tree itself, or inside a chain's state)."""
    return [x for x in jax.tree.leaves(tree, is_leaf=_is_shampoo_state)
            if isinstance(x, ShampooState)]


def _is_text_entry(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.dtype.kind == "U" and x.ndim == 0


def _is_format_entry(x: Any) -> bool:
    return _is_text_entry(x) and str(x[()]).startswith(_FORMAT_PREFIX)


def _is_config_entry(x: Any) -> bool:
    return _is_text_entry(x) and not _is_format_entry(x)


def _parse(text: str, what: str) -> ShampooConfig:
    try:
        return ShampooConfig.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{what} is invalid: {e}") from e


def _differences(saved: str, current: str, what: str) -> list[str]:
    if saved == current:
        return []
    return config_differences(_parse(saved, what), _parse(current, "the current config"))


def _configs(tree: Any, config: ShampooConfig | None, name: str) -> list[str | None]:
    """The config (JSON) of each Shampoo state in ``tree``; ``config`` must agree with them."""
    carried = [None if s.info is None else s.info.config for s in _shampoo_states(tree)]
    if config is None:
        return carried
    if not isinstance(config, ShampooConfig):
        raise ValueError(
            f"config = {config!r} is invalid: allowed a shampoo_spec.ShampooConfig or None."
        )
    given = config_json(config)
    for c in carried:
        diffs = [] if c is None else _differences(c, given, f"the config {name} carries")
        if diffs:
            raise ValueError(
                f"config is not the config {name} was initialised under; fields that differ "
                f"({name} -> config): {'; '.join(diffs)}."
            )
    return [given] * max(1, len(carried))


def _layout_without(like: Any, fields: tuple[str, ...]) -> list[str] | None:
    """The leaf paths of ``like`` with ``fields`` of its Shampoo states absent (an older format).

    None when ``like`` has none of them (nothing older to recognise).
    """
    if not any(getattr(s, f) is not None for s in _shampoo_states(like) for f in fields):
        return None
    old = jax.tree.map(
        lambda x: x._replace(**dict.fromkeys(fields)) if isinstance(x, ShampooState)  # type: ignore[arg-type]
        else x,
        like, is_leaf=_is_shampoo_state,
    )
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(old)[0]]


def _with_zeros(arrays: list[np.ndarray], old: list[str], paths: list[str],
                leaves: list[Any]) -> list[np.ndarray]:
    """``arrays`` of the older layout ``old`` in the current one; new fields start at zero."""
    by_path = dict(zip(old, arrays, strict=True))
    return [by_path[p] if p in by_path else np.zeros(tuple(ref.shape), np.dtype(ref.dtype))
            for p, ref in zip(paths, leaves, strict=True)]


def state_to_arrays(state: Any, config: ShampooConfig | None = None) -> list[np.ndarray]:
    """The state's arrays as NumPy, in ``jax.tree.flatten`` order, then its config (the format).

    ``state``: a :class:`ShampooState` (or a pytree holding them, such as an
    ``optax.chain`` state). The config each Shampoo state carries follows
    the arrays as one entry (:func:`config_array`), so
    :func:`state_from_arrays` refuses the arrays under another config.
    ``config`` (optional): must equal the carried config; it is stored for
    a hand-built state that carries none.
    """
    stored = _configs(state, config, "the state")
    if not stored or any(c is None for c in stored):
        warnings.warn(
            "the state carries no config (not made by shampoo(config).init): the checkpoint "
            "holds none, so loading it cannot check the config; pass config=.", stacklevel=2,
        )
        stored = []
    arrays = [np.asarray(x) for x in jax.tree.leaves(state)]
    return arrays + [np.asarray(FORMAT)] + [np.asarray(c) for c in stored]


def state_from_arrays(
    arrays: list[np.ndarray], like: Any, config: ShampooConfig | None = None
) -> Any:
    """Rebuild a state with the structure (and dtypes) of ``like`` from ``arrays``.

    ``like``: a freshly initialised state (``opt.init(params)``) or its
    shapes (``jax.eval_shape``), made under the config of the run that
    resumes. Raises ``ValueError``, before building anything, when the
    arrays were saved under another config (naming every field that
    differs), hold no config entry but the current layout, do not match
    ``like``'s shapes and dtypes, or hold a NaN or inf (naming the state
    field). ``config`` (optional): must equal ``like``'s config; checked
    against the arrays where ``like`` carries none. Checkpoints written
    before configs were stored load with a ``UserWarning`` (module
    docstring).
    """
    return _load(arrays, like, config, stacklevel=3)


def _load(arrays: list[np.ndarray], like: Any, config: ShampooConfig | None,
          stacklevel: int) -> Any:
    keyed, treedef = jax.tree_util.tree_flatten_with_path(like)
    paths = [jax.tree_util.keystr(k) for k, _ in keyed]
    leaves = [x for _, x in keyed]
    arrays = [np.asarray(a) for a in arrays]
    saved: list[str] = []
    while arrays and _is_config_entry(arrays[-1]):
        saved.insert(0, str(arrays.pop()[()]))
    current_format = bool(arrays) and _is_format_entry(arrays[-1])
    if current_format:
        found = str(arrays.pop()[()])
        if found != FORMAT:
            raise ValueError(
                f"the checkpoint's format entry is {found!r}: allowed {FORMAT!r} (written by "
                "another version of shampoo_jax)."
            )
    current = _configs(like, config, "like")
    known = bool(current) and all(c is not None for c in current)
    if saved:
        if not known:
            warnings.warn(
                "like carries no config (not made by shampoo(config).init) and none was given: "
                "the checkpoint's config is not checked; pass config=.", stacklevel=stacklevel,
            )
        elif len(saved) != len(current):
            raise ValueError(
                f"the checkpoint holds {len(saved)} configs; like holds {len(current)} Shampoo "
                "states: pass the state the checkpoint was written from."
            )
        else:
            for i, (a, b) in enumerate(zip(saved, current, strict=True)):
                diffs = _differences(a, cast(str, b), "the checkpoint's config entry")
                if diffs:
                    which = f" (Shampoo state {i})" if len(saved) > 1 else ""
                    raise ValueError(
                        f"the checkpoint was saved under another config{which}; fields that "
                        f"differ (saved -> current): {'; '.join(diffs)}."
                    )
        if not current_format:  # written before the update guard, or damaged
            before_guard = _layout_without(like, _GUARD_FIELDS)
            if before_guard is None or len(arrays) != len(before_guard):
                raise ValueError(
                    f"the checkpoint has config entries but no format entry and {len(arrays)} "
                    "arrays: a checkpoint written before the update guard has "
                    f"{len(before_guard or leaves)}, state_to_arrays writes a format entry "
                    f"({FORMAT!r}); the arrays are damaged."
                )
            arrays = _with_zeros(arrays, before_guard, paths, leaves)
    else:
        old = _layout_without(like, ("skipped_per_parameter", *_GUARD_FIELDS))
        if not current_format and old is not None and len(arrays) == len(old) != len(leaves):
            warnings.warn(
                "the checkpoint holds no config (written before configs were stored): loaded "
                "without checking the config; the per-parameter skip counters "
                "(skipped_per_parameter) start at zero.", stacklevel=stacklevel,
            )
            arrays = _with_zeros(arrays, old, paths, leaves)
        elif known and (current_format or len(arrays) == len(leaves)):
            raise ValueError(
                "the arrays hold no config entry but have the current layout (state_to_arrays "
                "always stores the config, so the entry was dropped): refused; append "
                "config_array(config) to resume under a known config on purpose."
            )
    if len(leaves) != len(arrays):
        raise ValueError(
            f"len(arrays) = {len(arrays)} is invalid: the state has {len(leaves)} arrays."
        )
    arrays = [_bfloat16_from_void(arr, ref) for arr, ref in zip(arrays, leaves, strict=True)]
    for i, (path, ref, arr) in enumerate(zip(paths, leaves, arrays, strict=True)):
        if tuple(ref.shape) != tuple(arr.shape) or np.dtype(ref.dtype) != arr.dtype:
            raise ValueError(
                f"array {i} (state field {path}) has shape {arr.shape} and dtype {arr.dtype}; "
                f"the state needs {tuple(ref.shape)} {np.dtype(ref.dtype)}."
            )
        if jnp.issubdtype(arr.dtype, jnp.inexact) and not bool(np.all(np.isfinite(arr))):
            bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
            raise ValueError(
                f"array {i} (state field {path}) holds {bad} non-finite entries (NaN or inf); "
                "allowed: finite values (a Shampoo state stays finite, so the checkpoint is "
                "damaged)."
            )
    return jax.tree.unflatten(treedef, [jnp.asarray(a) for a in arrays])


def _bfloat16_from_void(arr: np.ndarray, ref: Any) -> np.ndarray:
    """A bfloat16 array as ``numpy.load`` returns it (raw 2-byte voids) read as bfloat16.

    NumPy has no bfloat16: ``numpy.savez`` writes ml_dtypes' bfloat16 (the
    inverse roots with ``inverse_root_dtype="bfloat16"``, eq. 11a) as the
    void dtype ``|V2``, bytes intact. Only where ``like`` needs bfloat16 and
    the array is exactly that, so no other dtype is ever reinterpreted; the
    checks that follow (shape, dtype, finiteness) then apply as to any array.
    """
    if (np.dtype(ref.dtype) == np.dtype(jnp.bfloat16) and arr.dtype.kind == "V"
            and arr.dtype.itemsize == 2 and arr.dtype.fields is None):
        return arr.view(np.dtype(jnp.bfloat16))
    return arr


def sharded_state_to_arrays(
    state: Any, like: Any, sharding: ShardingConfig, config: ShampooConfig | None = None
) -> list[np.ndarray]:
    """A state sharded by ``sharding`` -> the arrays of the single-device layout.

    ``like``: the single-device state or its shapes,
    ``jax.eval_shape(shampoo(config).init, params)``. Padding is dropped;
    the config is stored as in :func:`state_to_arrays` (``config`` likewise).
    """
    return state_to_arrays(unshard_state(state, like, sharding), config)


def sharded_state_from_arrays(
    arrays: list[np.ndarray],
    like: Any,
    sharding: ShardingConfig,
    params: Any | None = None,
    config: ShampooConfig | None = None,
) -> Any:
    """Single-device-layout arrays -> a state padded and placed for ``sharding``.

    ``like`` as in :func:`sharded_state_to_arrays`; ``params`` (optional):
    elementwise states take their NamedShardings. The config, shapes,
    dtypes and finiteness are checked as in :func:`state_from_arrays`.
    """
    return shard_state(_load(arrays, like, config, stacklevel=3), sharding, params)


__all__ = [
    "config_array",
    "sharded_state_from_arrays",
    "sharded_state_to_arrays",
    "state_from_arrays",
    "state_to_arrays",
]
