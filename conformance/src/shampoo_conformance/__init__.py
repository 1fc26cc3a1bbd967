"""shampoo_conformance: check any Shampoo backend against the spec and the reference.

``get_backend(name)`` returns a backend with ``run(config, params, grads,
dtype)`` (the backend contract, docs/conformance.md); ``"reference"`` is built in, and any
``"package.module:factory"`` names a third-party backend.
"""

from .adapters.reference import ReferenceBackend
from .backends import BackendUnavailable, available_backends, get_backend
from .protocol import Backend

__all__ = [
    "Backend",
    "BackendUnavailable",
    "ReferenceBackend",
    "available_backends",
    "get_backend",
]
