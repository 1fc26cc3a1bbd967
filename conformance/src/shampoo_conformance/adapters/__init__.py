"""Adapters: each of our backends (the backend contract, docs/conformance.md) as one module.

``reference`` (the float64 oracle; :mod:`.first_order` holds its NumPy
AdamW), ``torch``, ``torch_ddp`` and ``torch_fsdp2`` (the PyTorch optimizer
in one process, and over two gloo ranks on the processes of
:mod:`.gloo_pool`), ``jax`` and ``jax_sharded`` (the optax transformation on
one device and sharded over four host devices). Each module has
``run(config, params, grads, dtype)`` and, where it can train closed-loop,
``stepper(...)``; :mod:`.inputs` holds the input checks they share. The
implementations never import this package; the third-party libraries'
adapters are :mod:`shampoo_conformance.thirdparty`.
"""
