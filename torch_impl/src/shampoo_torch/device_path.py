"""Which branch a device-dependent choice takes: the CPU's or an accelerator's.

Every choice of the optimizer that depends on the device goes through
:func:`path_for`, so that the branch a CUDA device takes can run (and be
tested) on a machine without one:

- ``"cpu"``: a host read costs nothing to wait for, and small ops are cheap.
  The CPU path takes shortcuts that read a flag on the host (eq. 22's guard
  and eq. 18's norm skip their overflow-safe forms when a sum is finite; eq.
  3's ``"raise"`` is decided at once), computes float32 products through
  oneDNN (:mod:`.gemm`), applies a few elementwise functions one block at a
  time (:mod:`.invariance`), and bounds each phase's workspace tightly.
- ``"accelerator"``: every host read stalls the device queue and every op is
  a kernel launch. No host read in a non-root step; products by ``torch.bmm``;
  one call per stack; Newton's stopping test read every 8 iterations; larger
  workspaces.

``SHAMPOO_TORCH_PATH=accelerator`` forces the accelerator path on every device
(the CPU included); unset (or ``auto``), a CPU tensor takes the CPU path and
any other device the accelerator path. :func:`describe` says which, and why.
Device capabilities that are not a choice of path (MPS has no float64,
:func:`shampoo_torch.refusal.bound_dtype`) are read from the device itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal, TypeVar

import torch

#: The environment variable that forces a path.
ENV = "SHAMPOO_TORCH_PATH"
Path = Literal["cpu", "accelerator"]
#: The values :data:`ENV` may take.
CHOICES = ("auto", "accelerator")
T = TypeVar("T")


def _forced() -> bool:
    value = os.environ.get(ENV, "auto") or "auto"
    if value not in CHOICES:
        raise ValueError(
            f"{ENV} = {value!r} is invalid: allowed one of {', '.join(map(repr, CHOICES))} "
            "('accelerator' takes the branches a CUDA device takes, on any device)."
        )
    return value == "accelerator"


def path_for(device: torch.device | str) -> Path:
    """``"cpu"`` or ``"accelerator"``: the branch the device-dependent choices take on
    ``device`` (``"accelerator"`` on every device under ``SHAMPOO_TORCH_PATH=accelerator``)."""
    if _forced():
        return "accelerator"
    return "cpu" if torch.device(device).type == "cpu" else "accelerator"


def on_cpu_path(device: torch.device | str) -> bool:
    """Whether ``device`` takes the CPU path (host reads are free there)."""
    return path_for(device) == "cpu"


def moved(x: torch.Tensor, device: torch.device | None = None,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x.to(device, dtype)``, or x itself where it is already there: a no-op ``.to``
    still dispatches an op (host time per call, and one more entry in the step's
    launch count, :mod:`shampoo_conformance.bench.launches`)."""
    if (device is None or x.device == device) and (dtype is None or x.dtype == dtype):
        return x
    return x.to(device=device, dtype=dtype)


_SCALARS: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor of ``value`` on ``device``, made once per process: an operand of
    ``torch.where`` given as a Python number is a new tensor (and its launches) at
    every call."""
    key = (float(value).hex(), dtype, torch.device(device))  # hex: NaN is one key
    if key not in _SCALARS:
        _SCALARS[key] = torch.full((), value, dtype=dtype, device=device)
    return _SCALARS[key]


def batches(items: Sequence[T], device: torch.device | str) -> list[Sequence[T]]:
    """``items`` as the batches of one ``torch._foreach_*`` call each: all of them on
    the accelerator path (one launch for the lot), one by one on the CPU path (a
    CPU foreach op runs tensor by tensor anyway, and one at a time keeps one
    parameter's temporaries alive, not every parameter's)."""
    if not items:
        return []
    return [items] if not on_cpu_path(device) else [[x] for x in items]


def describe(device: torch.device | str) -> str:
    """Which path ``device`` takes, and why, in words (for logs and benchmark tables)."""
    kind = torch.device(device).type
    path = path_for(device)
    if _forced() and kind == "cpu":
        return f"accelerator (forced by {ENV}=accelerator on a {kind} device)"
    return f"{path} (a {kind} device)"


__all__ = ["CHOICES", "ENV", "Path", "batches", "describe", "moved", "on_cpu_path", "path_for",
           "scalar"]
