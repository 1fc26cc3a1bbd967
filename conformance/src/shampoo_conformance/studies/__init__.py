"""Studies that run no backend: what the spec's plan and cost model say at scale.

:mod:`.scaling`: the block plan and owners on Llama-2 shapes, 8 to 4096 ranks
(``python -m shampoo_conformance scaling``, docs/scaling.md).
"""
