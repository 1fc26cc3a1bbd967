"""``shampoo_torch.from_meta_distributed``: Meta's ``distributed_config`` as the
``distributed`` argument that reproduces it (anchors/test_meta_library.py runs
Meta's distributors against it)."""

from __future__ import annotations

from typing import Any

import pytest

from shampoo_spec import from_meta
from shampoo_torch import DistributedConfig, from_meta_distributed

BASE: dict[str, Any] = {"lr": 0.1, "max_preconditioner_dim": 64,
                        "grafting_config": {"type": "AdaGradPreconditionerConfig"}}
FULLY, HYBRID = "FullyShardDistributedConfig", "HybridShardDistributedConfig"


@pytest.mark.parametrize(("dist", "want"), [
    (None, None),
    ({"type": "SingleDeviceDistributedConfig"}, None),
    ({"type": "DDPDistributedConfig", "communication_dtype": "bfloat16"}, "lossless"),
    ({"type": FULLY, "param_assignment_strategy": "REPLICATE"}, "lossless"),
    ({"type": HYBRID, "param_assignment_strategy": "ROUND_ROBIN", "device_mesh": [2, 1]},
     "lossless"),
    ({"type": FULLY}, "local"),
    ({"type": HYBRID, "param_assignment_strategy": "DEFAULT", "device_mesh": [1, 2],
      "communication_dtype": "bfloat16"}, "local"),
])
def test_each_distribution_gets_its_shard_mode(dist: dict[str, Any] | None,
                                               want: str | None) -> None:
    kwargs = {**BASE, "distributed_config": dist}
    config, distributed = from_meta_distributed(kwargs)
    if want is None:
        assert distributed is None
    else:
        assert distributed == DistributedConfig(shard_mode=want)
    # The numerics of a piece are those of a parameter: the config is the
    # whole-parameter strategy's (the update rounded as Meta's all-gather, eq. 21a).
    whole = kwargs if want != "local" else {
        **kwargs, "distributed_config": {**kwargs["distributed_config"],
                                         "param_assignment_strategy": "REPLICATE"}}
    assert config == from_meta(whole)
    if dist is not None and dist["type"] == HYBRID:
        assert config.update_dtype == dist.get("communication_dtype", "float32")


def test_legacy_fsdp_stays_refused_naming_the_type() -> None:
    for kind in ("FSDPDistributedConfig", "HSDPDistributedConfig"):
        with pytest.raises(NotImplementedError, match=f"distributed_config.type = '{kind}'"):
            from_meta_distributed({**BASE, "distributed_config": {"type": kind}})
