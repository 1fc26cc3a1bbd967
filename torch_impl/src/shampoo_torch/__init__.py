"""shampoo_torch: Shampoo as a ``torch.optim.Optimizer``, batched, CPU and CUDA.

- :class:`Shampoo`: every option of ``shampoo_spec.ShampooConfig``, equal to
  the float64 reference (``shampoo_reference``) within docs/spec.md section 5;
- :class:`DistributedConfig`: ``Shampoo(..., distributed=DistributedConfig())``
  spreads the block work over torch.distributed ranks, equal to one process;
- :class:`NonFiniteGradientError`, :class:`RootFailureError`: the failure policy;
- :func:`shampoo_torch.testing.run`: numpy in, numpy out (conformance contract 8.2);
- ``python -m shampoo_torch.bench``: step time against AdamW, FLOP rate;
- ``python -m shampoo_torch.bench_distributed``: 2 ranks vs 1 (root time, memory).

Equation numbers in docstrings refer to docs/spec.md.
"""

from shampoo_spec import NonFiniteGradientError, RootFailureError

from .distributed import DistributedConfig
from .optimizer import Shampoo

__all__ = ["DistributedConfig", "NonFiniteGradientError", "RootFailureError", "Shampoo"]
