"""shampoo_torch: Shampoo as a ``torch.optim.Optimizer``, batched, CPU and CUDA.

- :class:`Shampoo`: every option of ``shampoo_spec.ShampooConfig``, equal to
  the float64 reference (``shampoo_reference``) within docs/spec.md section 5;
- :class:`NonFiniteGradientError`, :class:`RootFailureError`: the failure policy;
- :func:`shampoo_torch.testing.run`: numpy in, numpy out (conformance contract 8.2);
- ``python -m shampoo_torch.bench``: step time against AdamW, FLOP rate.

Equation numbers in docstrings refer to docs/spec.md.
"""

from .errors import NonFiniteGradientError, RootFailureError
from .optimizer import Shampoo

__all__ = ["NonFiniteGradientError", "RootFailureError", "Shampoo"]
