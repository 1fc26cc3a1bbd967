"""Google's ``distributed_shampoo``: its arguments (:mod:`.keys`), their import
(:mod:`.importer`, with :mod:`.import_preconditioner`) and export (:mod:`.exporter`)."""

from .exporter import to_google
from .importer import from_google
from .keys import ConstantSchedule

__all__ = ["ConstantSchedule", "from_google", "to_google"]
