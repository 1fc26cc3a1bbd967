"""Meta's ``DistributedShampoo`` keyword arguments as :class:`~shampoo_torch.Shampoo`'s.

:func:`shampoo_spec.from_meta` gives the config; which parameters Meta's
``distributed_config`` steps (:func:`shampoo_spec.meta_distribution`) says
what ``distributed`` reproduces it here. Meta's single-device, DDP and
lossless FSDP2 distributors have single-device numerics, as does
:class:`DistributedConfig` (lossless) on any of them; Meta's default FSDP2
distributors (FullyShard/HybridShard, ``param_assignment_strategy`` DEFAULT)
step each rank's piece of a ``fully_shard`` parameter as a parameter of its
own, as ``shard_mode="local"`` does (:mod:`shampoo_torch.sharding`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shampoo_spec import ShampooConfig, from_meta, meta_distribution

from .distributed import DistributedConfig


def from_meta_distributed(
    kwargs: Mapping[str, Any],
) -> tuple[ShampooConfig, DistributedConfig | None]:
    """``(config, distributed)`` such that ``Shampoo(params, config, distributed=distributed)``
    steps as Meta's ``DistributedShampoo(params, **kwargs)`` does.

    ``distributed`` is None without a ``distributed_config`` (or with
    SingleDeviceDistributedConfig); ``DistributedConfig()`` for DDP and for
    FullyShard/HybridShard with REPLICATE or ROUND_ROBIN (Meta's
    ``communication_dtype`` rounding is the config's ``update_dtype``, eq. 21a);
    ``DistributedConfig(shard_mode="local")`` for FullyShard/HybridShard with
    DEFAULT, whose config is ``from_meta(kwargs, shard_local=True)``. Build
    the ``fully_shard`` model and the process group as for Meta's optimizer.
    """
    kind = meta_distribution(kwargs)
    config = from_meta(kwargs, shard_local=kind == "pieces")
    if kind == "single_device":
        return config, None
    return config, DistributedConfig(shard_mode="local" if kind == "pieces" else "lossless")
