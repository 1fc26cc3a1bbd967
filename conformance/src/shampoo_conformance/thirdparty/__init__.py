"""Other people's Shampoo as conformance backends.

:mod:`.registry` names every library backend (``meta``, ``google``,
``tearfree``, ``pytorch-optimizer``, ``pytorch-optimizer-shampoo``,
``pytorch-optimizer-soap``, ``heavyball-soap``), its adapter module and its
install command, and holds the vocabulary of a documented
:class:`~.registry.Deviation`. One adapter module per library backend
(:mod:`.meta`, :mod:`.google`, :mod:`.tearfree`, :mod:`.pytorch_optimizer`,
:mod:`.pytorch_optimizer_shampoo`, :mod:`.pytorch_optimizer_soap`,
:mod:`.heavyball_soap`); what the torch libraries share is
:mod:`.torch_library`, what the two SOAPs share :mod:`.soap` (SOAP in the
spec's terms) and :mod:`.soap_backend` (their adapter functions).
:mod:`.anchor_cases` holds the argument sets the anchors check against the
real libraries. Importing an adapter fails when its library is missing.
"""
