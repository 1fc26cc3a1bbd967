"""Import the anchors' arguments into a :class:`ShampooConfig` (contract 8.1).

``from_meta(kwargs)`` takes the keyword arguments of Meta's
``DistributedShampoo(...)`` in JSON form; ``from_google(kwargs)`` those of
Google's ``distributed_shampoo(...)``; ``from_tearfree(options,
learning_rate)`` the ``TearfreeOptions`` of Google's ``precondition.tearfree``
(:mod:`.tearfree`). Missing keys take that library's
defaults, and running the result reproduces that library's numerics (Meta:
single device; Google: the non-sharded path). Options we do not implement
raise ``NotImplementedError`` naming the key; malformed values raise
``ValueError`` naming the key path, the value and what is allowed. Enums
are read by member name, ``"Enum.NAME"`` or (Google's IntEnums) value;
dtypes as ``"float32"`` or ``"torch.float32"``. ``from_google(kwargs,
x64=False)`` gives float32 factors, as Google runs without 64-bit JAX.
docs/spec.md section 4 tabulates every mapping; docs/migrating.md
inventories every argument of both libraries. ``meta_distribution(kwargs)``
says how Meta's ``distributed_config`` steps the parameters (whole, or each
rank's piece: ``from_meta(kwargs, shard_local=True)``). The inverse is
:mod:`shampoo_spec.exporters`.

Layout: :mod:`._parse` reads values (shared by both), :mod:`.meta` and
:mod:`.google` each build the config one section at a time, one helper per
section of the anchor's arguments.
"""

from .google import from_google
from .meta import MetaDistribution, from_meta, meta_distribution
from .tearfree import from_tearfree

__all__ = ["MetaDistribution", "from_google", "from_meta", "from_tearfree", "meta_distribution"]
