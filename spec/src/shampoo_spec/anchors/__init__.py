"""The anchors' arguments in and out of a :class:`ShampooConfig` (the importer contract).

One sub-package per anchor, its import and export side by side:
:mod:`.meta` (Meta's ``DistributedShampoo``), :mod:`.google` (Google's
``distributed_shampoo``) and :mod:`.tearfree` (Google's
``precondition.tearfree``), each with its argument tables (``keys``), its
importer (``from_x``, one helper per section of the anchor's arguments) and
its exporter (``to_x``). :mod:`._parse` holds the strict value readers the
importers share, :mod:`._export` what the exporters share.

``from_meta(kwargs)`` takes the keyword arguments of Meta's
``DistributedShampoo(...)`` in JSON form; ``from_google(kwargs)`` those of
Google's ``distributed_shampoo(...)``; ``from_tearfree(options,
learning_rate)`` the ``TearfreeOptions`` of Google's ``precondition.tearfree``.
Missing keys take that library's defaults, and running the result reproduces
that library's numerics (Meta: single device; Google: the non-sharded path).
Options we do not implement raise ``NotImplementedError`` naming the key;
malformed values raise ``ValueError`` naming the key path, the value and what
is allowed. Enums are read by member name, ``"Enum.NAME"`` or (Google's
IntEnums) value; dtypes as ``"float32"`` or ``"torch.float32"``.
``from_google(kwargs, x64=False)`` gives float32 factors, as Google runs
without 64-bit JAX. docs/spec.md section 4 tabulates every mapping;
docs/migrating.md inventories every argument of both libraries.
``meta_distribution(kwargs)`` says how Meta's ``distributed_config`` steps the
parameters (whole, or each rank's piece: ``from_meta(kwargs, shard_local=True)``).

``to_meta(config)``, ``to_google(config)`` and ``to_tearfree(config)`` are the
inverses: ``from_x(to_x(c)) == c`` for every config the target can express,
and one ``ValueError`` names every field it cannot.
"""

from .google import from_google, to_google
from .meta import MetaDistribution, from_meta, meta_distribution, to_meta
from .tearfree import from_tearfree, to_tearfree

__all__ = [
    "MetaDistribution",
    "from_google",
    "from_meta",
    "from_tearfree",
    "meta_distribution",
    "to_google",
    "to_meta",
    "to_tearfree",
]
