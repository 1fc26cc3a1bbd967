"""The optimizer's counters (:attr:`shampoo_torch.Shampoo.metrics`): device tensors, read lazily.

One set of counters per device the step runs on, so counting never moves a
value to the host; :meth:`StepCounters.read` sums them on the host when asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: The counters, in :attr:`shampoo_torch.Shampoo.metrics`' order.
COUNTERS = ("root_failures", "skipped_blocks", "withheld_updates")


class StepCounters:
    """``root_failures`` (eq. 13), ``skipped_blocks`` (eq. 3) and ``withheld_updates``
    (eq. 22) since construction, one int64 device tensor each per device."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The counters on ``device`` (zeros when first asked), to add to in place."""
        if device not in self.by_device:
            self.by_device[device] = {
                name: torch.zeros((), dtype=torch.int64, device=device)
                for name in ("root_failures", "skipped_blocks", "withheld_updates")
            }
        return self.by_device[device]

    def read(self) -> dict[str, int]:
        """Every counter summed over the devices (this reads the devices)."""
        out = {"root_failures": 0, "skipped_blocks": 0, "withheld_updates": 0}
        for counters in self.by_device.values():
            for name, value in counters.items():
                out[name] += int(value)
        return out

    def restore(self, metrics: Mapping[str, Any], device: torch.device | None,
                root_failures: bool) -> None:
        """Set the counters to saved counts, held on ``device`` (None: no parameter, so no
        counter); ``root_failures``: whether this process takes the saved root failures.

        ``root_failures`` is a sum over the ranks of a trainer group (each
        counts its own blocks), so only rank 0 of a distributed optimizer
        takes the saved total.
        """
        self.by_device.clear()
        if device is None:
            return
        counters = self.on(device)
        for name in ("skipped_blocks", "withheld_updates"):  # the same on every rank
            counters[name].fill_(int(metrics.get(name, 0)))
        if root_failures:
            counters["root_failures"].fill_(int(metrics.get("root_failures", 0)))
