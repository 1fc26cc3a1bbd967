"""Benchmarks: each prints ratios measured side by side on one machine (docs/results.md).

Each module runs as ``python -m shampoo_conformance.bench.<name>``:

- :mod:`.torch_step`: a training step of the torch optimizer against AdamW,
  FLOP rate (``--threads``, ``--period``);
- :mod:`.torch_variants`: the same step for each preconditioner family;
- :mod:`.torch_distributed`: 2 gloo ranks against 1 (root time, memory);
- :mod:`.jax_step`: the optax transformation against ``optax.adamw``;
- :mod:`.jax_sharded`: the sharded JAX step on N host devices against one;
- :mod:`.anchors`: ours, Meta's / Google's library and AdamW side by side;
- :mod:`.fsdp2`: per-rank FSDP2 state and step time at 1, 2 and 4 gloo ranks;
- :mod:`.scale`: cost against AdamW at block sizes 256-2048, widths 512-4096.

``nox -s bench``, ``bench_anchors`` and ``bench_scale`` run them. The
optimizers never import this package.
"""
