"""Meta's ``DistributedShampoo``: its arguments (:mod:`.keys`), their import
(:mod:`.importer`, with :mod:`.import_distribution`, :mod:`.import_preconditioner`,
:mod:`.import_roots`, :mod:`.import_exponents`) and export (:mod:`.exporter`, with
:mod:`.export_roots`)."""

from .exporter import to_meta
from .import_distribution import MetaDistribution, meta_distribution
from .importer import from_meta

__all__ = ["MetaDistribution", "from_meta", "meta_distribution", "to_meta"]
