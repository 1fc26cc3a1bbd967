"""Adapters: each backend of contract 8.2 as one module.

``reference`` (the float64 oracle), ``torch`` and ``torch_ddp`` (the PyTorch
optimizer in one process and over two gloo ranks), ``jax`` and
``jax_sharded`` (the optax transformation on one device and sharded over four
host devices). Each module has ``run(config, params, grads, dtype)`` and,
where it can train closed-loop, ``stepper(...)``; :mod:`.inputs` holds the
input checks they share. The implementations never import this package.
"""
