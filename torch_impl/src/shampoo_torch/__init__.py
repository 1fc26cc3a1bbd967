"""shampoo_torch: Shampoo as a ``torch.optim.Optimizer``, batched, CPU and CUDA.

- :class:`Shampoo`: every option of ``shampoo_spec.ShampooConfig``, equal to
  the float64 reference (``shampoo_reference``) within docs/spec.md section 5;
  :meth:`Shampoo.blocks` yields a read-only :class:`BlockView` of each block's
  Kronecker state;
- :class:`DistributedConfig`: ``Shampoo(..., distributed=DistributedConfig())``
  spreads the block work over torch.distributed ranks, equal to one process;
- :func:`from_meta_distributed`: Meta's ``DistributedShampoo`` kwargs as the
  config and the :class:`DistributedConfig` that reproduce its numerics;
- :class:`NonFiniteGradientError`, :class:`RootFailureError`: the failure policy;
- :func:`path_for`, :func:`describe`: which branch the device-dependent choices
  take, the CPU's or an accelerator's (``SHAMPOO_TORCH_PATH=accelerator`` forces
  the accelerator path on any device, :mod:`.device_path`);
- its benchmarks live in ``shampoo_conformance.bench`` (``torch_step``,
  ``torch_variants``, ``torch_distributed``, ``anchors``, ``scale``, ``fsdp2``).

Modules: :mod:`.optimizer` (the step's phases), :mod:`.preconditioner` (the
maths of one block group: statistics, inverse roots, directions),
:mod:`.blocks` (block groups: equal-shape blocks stacked), :mod:`.roots` (``regularize``,
``eigh``, ``basis``, ``newton``, ``lobpcg``, ``sketch``, ``dispatch``),
:mod:`.grafting`, :mod:`.elementwise`, :mod:`.distributed`,
:mod:`.checkpoint`, :mod:`.processes` (fresh gloo processes for tests and
benchmarks). The conformance adapters (numpy in, numpy out, the backend contract)
are ``shampoo_conformance.adapters.torch`` and ``.torch_ddp``; this package
never imports shampoo_conformance.

Equation numbers in docstrings refer to docs/spec.md.
"""

from shampoo_spec import NonFiniteGradientError, RootFailureError

from .device_path import describe, path_for
from .distributed import DistributedConfig
from .meta_import import from_meta_distributed
from .optimizer import Shampoo
from .state import BlockView

__all__ = [
    "BlockView",
    "DistributedConfig",
    "NonFiniteGradientError",
    "RootFailureError",
    "Shampoo",
    "describe",
    "from_meta_distributed",
    "path_for",
]
