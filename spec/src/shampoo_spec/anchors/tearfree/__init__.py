"""Google's ``precondition.tearfree``: its options (:mod:`.keys`), their import
(:mod:`.importer`) and export (:mod:`.exporter`)."""

from .exporter import to_tearfree
from .importer import from_tearfree

__all__ = ["from_tearfree", "to_tearfree"]
