"""The conformance suite: properties every Shampoo backend must satisfy.

Run it with ``pytest --pyargs shampoo_conformance.suite --backend NAME`` or
``python -m shampoo_conformance run --backend NAME``.
"""
