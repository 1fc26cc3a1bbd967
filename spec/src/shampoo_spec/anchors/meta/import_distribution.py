"""Meta's ``distributed_config`` (and ``use_merge_dims``): which pieces are stepped and
how the update is rounded (eq. 21a), for :func:`~.importer.from_meta`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from ...config import (
    UpdateDtype,
)
from .._parse import (
    _INF_NAMES,
    Args,
    boolean,
    choice,
    dtype,
    integer,
    type_of,
)
from .keys import (
    KEYS,
    TORCH,
)


def _distribution(a: Args, shard_local: bool = False) -> tuple[int | None, UpdateDtype | None]:
    """Reads ``distributed_config``, ``use_merge_dims``; returns the target rank
    and ``update_dtype``.

    Accepts the layouts whose numerics are single-device ones (none,
    SingleDevice, DDP, the lossless FSDP2 ones: :func:`_fully_shard`; dims
    merged), and, with ``shard_local``, only the FSDP2 ones with
    ``param_assignment_strategy`` DEFAULT (each rank's dim-0 piece a parameter
    of its own). FSDPDistributedConfig and HSDPDistributedConfig (each
    parameter's part of an FSDP1 flat-parameter shard split into rectangular
    pieces, Meta's split tensor block recovery) are refused.
    Returns ``target_parameter_dimensionality`` (default 1; None for inf:
    neither squeeze nor merge) and, for DDP and HybridShard,
    ``update_dtype`` (eq. 21a): :func:`_ddp_update_dtype`.
    """
    dist = a.get("distributed_config", None)
    kind = type_of("distributed_config", dist)
    if kind in _FULLY_SHARD_KEYS:
        update_dtype = _fully_shard(kind, dist, shard_local)
    elif shard_local:
        raise ValueError(
            f"shard_local = True is invalid with distributed_config.type = {kind!r}: it "
            "imports FullyShardDistributedConfig or HybridShardDistributedConfig with "
            "param_assignment_strategy DEFAULT (each rank's piece a parameter of its own)."
        )
    elif kind in (None, "SingleDeviceDistributedConfig", "DDPDistributedConfig"):
        update_dtype = _ddp_update_dtype(dist) if kind == "DDPDistributedConfig" else None
    else:
        raise NotImplementedError(
            f"distributed_config.type = {kind!r} is not supported yet (FSDP/HSDP block "
            "the rectangular pieces of FSDP1's flat-parameter shards; "
            "FullyShardDistributedConfig and HybridShardDistributedConfig are: "
            "REPLICATE or ROUND_ROBIN lossless, DEFAULT with shard_local=True)."
        )
    target = (dist or {}).get("target_parameter_dimensionality", 1)
    if not a.flag("use_merge_dims", True):
        raise NotImplementedError("use_merge_dims = False is not supported yet.")
    if (isinstance(target, str) and target.strip().lower() in _INF_NAMES) or (
        isinstance(target, float) and target == math.inf
    ):
        return None, update_dtype
    return (integer("distributed_config.target_parameter_dimensionality", target, low=1),
            update_dtype)


#: What Meta's ``distributed_config`` does with the parameters (:func:`meta_distribution`).
MetaDistribution = Literal["single_device", "ddp", "whole_parameters", "pieces"]


def meta_distribution(kwargs: Mapping[str, Any]) -> MetaDistribution:
    """How Meta's ``distributed_config`` in ``kwargs`` steps the parameters.

    ``"single_device"`` (none or SingleDeviceDistributedConfig), ``"ddp"``
    (DDPDistributedConfig), ``"whole_parameters"`` (FullyShard/HybridShard with
    REPLICATE or ROUND_ROBIN: each whole parameter gathered) and ``"pieces"``
    (FullyShard/HybridShard with DEFAULT, Meta's default: each rank's dim-0
    piece of a ``fully_shard`` parameter stepped as a parameter of its own,
    which :func:`from_meta` imports with ``shard_local=True``). The first three
    have single-device numerics. FSDPDistributedConfig and
    HSDPDistributedConfig raise ``NotImplementedError``, as in
    :func:`from_meta`, which validates the rest of the section.
    """
    dist = kwargs.get("distributed_config", None)
    kind = type_of("distributed_config", dist)
    if kind in (None, "SingleDeviceDistributedConfig"):
        return "single_device"
    if kind == "DDPDistributedConfig":
        return "ddp"
    if kind not in _FULLY_SHARD_KEYS:
        _distribution(Args("from_meta", {"distributed_config": dist}, KEYS))  # raises
    strategy = choice("distributed_config.param_assignment_strategy",
                      dist.get("param_assignment_strategy", "DEFAULT"),
                      PARAM_ASSIGNMENT_STRATEGIES, enum="FSDPParamAssignmentStrategy")
    return "pieces" if strategy == "DEFAULT" else "whole_parameters"


#: ``FSDPParamAssignmentStrategy`` (member names; each value is its name).
PARAM_ASSIGNMENT_STRATEGIES = {name: name for name in ("DEFAULT", "REPLICATE", "ROUND_ROBIN")}

_FULLY_SHARD = {"target_parameter_dimensionality", "param_assignment_strategy",
                "num_sub_groups", "load_balancing_config"}
#: Meta's FSDP2 (``fully_shard``) config classes and their keys; HybridShard's
#: also DDPDistributedConfig's (it subclasses both) and its ``device_mesh``.
_FULLY_SHARD_KEYS = {
    "FullyShardDistributedConfig": _FULLY_SHARD,
    "HybridShardDistributedConfig": _FULLY_SHARD | {
        "device_mesh", "communication_dtype", "num_trainers_per_group", "communicate_params"},
}


def _fully_shard(kind: str, dist: Mapping[str, Any], shard_local: bool = False,
                 ) -> UpdateDtype | None:
    """Reads ``FullyShardDistributedConfig`` / ``HybridShardDistributedConfig`` (every key).

    ``param_assignment_strategy`` (an ``FSDPParamAssignmentStrategy`` name,
    default DEFAULT): REPLICATE and ROUND_ROBIN select Meta's
    ``FullyShardLosslessDistributor`` / ``HybridShardLosslessDistributor``
    (distributed_shampoo.py ``_select_distributor_class``), which gather each
    whole parameter and its whole gradient (``full_tensor`` or all_to_all)
    onto its owner rank(s), block and precondition it as one device does,
    and copy the updated parameter back into the shards: single-device
    numerics. DEFAULT (``FullyShardDistributor``, ``HybridShardDistributor``)
    merges and blocks each rank's nonempty local piece (``p.to_local()``) as a
    parameter of its own and exchanges no parameters: the same config on the
    pieces, imported only with ``shard_local`` (and only DEFAULT is then);
    HybridShard's replicas split its blocks and all-gather the updates as
    DDP does, so the update is rounded as below. ``num_sub_groups``
    (an int >= 1; > 1 needs REPLICATE or ROUND_ROBIN, Meta's rule) splits
    the group into groups with the same settings (``split_param_groups``);
    Meta couples no blocks (per-block graft norms and root-failure counters,
    the step counted per group every step), so it only places work, as do
    ``load_balancing_config``, ``device_mesh`` and ``num_trainers_per_group``.
    FullyShard adds the update to the parameters unrounded (the single-device
    ``Distributor.update_params``): ``update_dtype`` None. HybridShard's
    lossless distributor spreads the blocks over the replicas and all-gathers
    the updates (or, with ``communicate_params``, the parameters) in
    ``communication_dtype`` as DDP does (shampoo_hybrid_shard_distributor.py
    ``update_params``, inherited): :func:`_ddp_update_dtype`.
    """
    d = Args("distributed_config", dist, _FULLY_SHARD_KEYS[kind])
    strategy = choice("distributed_config.param_assignment_strategy",
                      d.get("param_assignment_strategy", "DEFAULT"),
                      PARAM_ASSIGNMENT_STRATEGIES, enum="FSDPParamAssignmentStrategy")
    sub_groups = d.integer("num_sub_groups", 1, low=1)
    if strategy == "DEFAULT":
        if sub_groups > 1:
            raise ValueError(
                f"distributed_config.num_sub_groups = {sub_groups} is invalid with "
                "param_assignment_strategy = 'DEFAULT': num_sub_groups > 1 needs REPLICATE "
                "or ROUND_ROBIN (Meta's FullyShardDistributedConfig rule)."
            )
        if not shard_local:
            raise ValueError(
                f"distributed_config.param_assignment_strategy = 'DEFAULT' ({kind}) blocks "
                "each rank's piece of a parameter, not the parameter: import it with "
                "from_meta(kwargs, shard_local=True) and run it on the pieces "
                "(shampoo_torch.from_meta_distributed gives the config and "
                "DistributedConfig(shard_mode='local')); REPLICATE or ROUND_ROBIN have "
                "single-device numerics."
            )
    elif shard_local:
        raise ValueError(
            f"shard_local = True is invalid with distributed_config.param_assignment_strategy "
            f"= {strategy!r}: its distributor gathers whole parameters (single-device "
            "numerics); shard_local imports DEFAULT only."
        )
    if kind == "FullyShardDistributedConfig":
        return None
    if d.get("device_mesh", None) is None:
        raise ValueError(
            "distributed_config.device_mesh is missing: HybridShardDistributedConfig needs "
            "its 2-D device mesh (replicate, shard)."
        )
    trainers = d.integer("num_trainers_per_group", -1, low=-1)
    if trainers == 0:
        raise ValueError("distributed_config.num_trainers_per_group = 0 is invalid: "
                         "allowed -1 or an integer >= 1.")
    return _ddp_update_dtype(dist)


def _ddp_update_dtype(dist: Mapping[str, Any]) -> UpdateDtype | None:
    """Reads ``DDPDistributedConfig.communication_dtype`` (default float32) and
    ``communicate_params`` (default False); returns ``update_dtype`` (eq. 21a).
    HybridShardDistributedConfig's are the same fields, used the same way.

    Meta's DDP distributor copies each block's update ``-lr P`` into an
    all-gather buffer of ``communication_dtype`` (rounding it) and adds the
    gathered buffer to the parameters, on every rank, its own blocks
    included, at any world size (shampoo_ddp_distributor.py
    ``update_params`` and ``_construct_distributed_buffers``). float32,
    bfloat16, float16: that dtype (float32 changes nothing for float32
    parameters and rounds float64 ones, as Meta); float64: None (nothing
    is rounded). With ``communicate_params`` Meta gathers the updated
    parameters instead, so the parameters themselves are rounded: refused
    for bfloat16/float16 (no option says it); float32 and float64 import as
    None (no effect on float32 parameters).
    """
    comm = dtype("distributed_config.communication_dtype",
                 dist.get("communication_dtype", "float32"), TORCH)
    if boolean("distributed_config.communicate_params", dist.get("communicate_params", False)):
        if comm in ("bfloat16", "float16"):
            raise NotImplementedError(
                f"distributed_config.communication_dtype = {comm!r} with communicate_params = "
                "True is not supported yet (Meta rounds the parameters themselves to it)."
            )
        return None
    return None if comm == "float64" else _UPDATE_DTYPES[comm]


#: ``communication_dtype`` values that round the update (eq. 21a).
_UPDATE_DTYPES: dict[str, UpdateDtype] = {
    "float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
}
