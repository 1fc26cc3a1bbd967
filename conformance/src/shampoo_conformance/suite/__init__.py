"""The conformance suite: properties every Shampoo backend must satisfy.

Run it with ``pytest --pyargs shampoo_conformance.suite --backend NAME`` or
``python -m shampoo_conformance run --backend NAME`` (:mod:`.runner`).

The properties are the ``test_*.py`` modules here (pytest collects this
folder); what they are built from: :mod:`.strategies` (Hypothesis
strategies of configs and problems), :mod:`.cases` (the named problems),
:mod:`.tolerances` (bounds derived from conditioning), :mod:`.divergence`
(the trajectory check) and :mod:`.pytest_plugin` (``--backend``, the
Hypothesis profiles). :mod:`.mutants` holds broken copies of the reference
the suite must kill. :mod:`.basis_reuse`, :mod:`.deflation_factors`,
:mod:`.eigh_failures` and :mod:`.rank_cutoff_problems` are problems and
probes the members' own tests share.
"""
