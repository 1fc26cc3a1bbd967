"""A fuzzer for hostile input: configs, importer arguments, shapes and gradient streams.

Nothing silently corrupt, every bad input named (docs/reliability.md).
Modules:

- :mod:`.values`: hostile scalars; a strategy for any field of any config section;
- :mod:`.configs`: hostile config recipes over ``dataclasses.fields`` of every
  section, valid step configs with extreme values, importer kwargs;
- :mod:`.data`: shapes (0-d to 4-d, size-1, size-0, a large dim), weights,
  hostile gradient streams, and which blocks eq. (3) must refuse;
- :mod:`.drivers`: one interface (step, snapshot, checkpoint) over the
  reference, torch and JAX;
- :mod:`.invariants`: the invariants (a)-(d), each raising :class:`Violation`,
  and :data:`COUNTS`, the cases run;
- :mod:`.corruption`: invariant (e), damaged checkpoints;
- :mod:`.distributed`: invariant (f), every torch distributed mode against one process.

``conformance/tests/test_fuzz.py`` runs it (Hypothesis profile ``ci`` in CI,
``fuzz`` in ``nox -s fuzz``).
"""

from .invariants import COUNTS, Violation

__all__ = ["COUNTS", "Violation"]
