"""Other people's Shampoo as conformance backends: the registry and its vocabulary.

A third-party backend runs a real library (Meta's ``DistributedShampoo``,
Google's ``distributed_shampoo``, ...) from the kwargs our exporters write.
Its adapter module (``shampoo_conformance.adapters.<name>``) provides, besides
the backend contract's ``run``:

- ``dtypes``: the parameter dtypes it runs;
- ``expressible(config, dtype) -> str | None``: why the library cannot run
  ``config`` (None when it can); ``run`` raises
  :class:`~shampoo_spec.Inexpressible` with that reason;
- ``configs()``: a Hypothesis strategy of the configs the library expresses
  (its own arguments, drawn and imported), which the suite's random-config
  properties draw instead of :func:`shampoo_conformance.suite.strategies.configs`;
- ``base_config()``: the library's config nearest ``ShampooConfig()``, from
  which the suite's fixed laws start (they replace the sections they test);
- ``CASES``: named configs from the library's own arguments (the ones
  ``nox -s anchors`` checks against the library on a model), which the
  suite's ``test_library_case_float64`` runs against the reference;
- ``DEVIATIONS``: the properties where the library as shipped differs from
  the spec, each with its cause (docs/third-party.md); the suite marks
  them as expected failures, so it fails only on an undocumented deviation;
- ``USER_KWARGS``: the arguments a user must give the library's constructor
  besides the parameters (the learning rate, for most), all others left at
  the library's defaults: what a user gets who changes nothing;
- ``defaults_config()``: the spec's config nearest what the library computes
  at ``USER_KWARGS`` (the suite's ``test_library_defaults`` runs the
  library there against the reference on it; every difference is a
  deviation);
- ``library_run(kwargs, params, grads, dtype)``: the library constructed
  from exactly ``kwargs`` (no adapter rule added), stepped with ``grads``
  as a user would, returning a :class:`LibraryRun` (the suite's
  side-effect properties read it: gradients, global RNG, dtypes, unknown
  arguments).

Importing an adapter fails when its library is missing; the backend is then
reported as unavailable with :attr:`ThirdParty.install`, never as an error.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from shampoo_spec import ShampooConfig, config_differences, config_from_dict, config_to_dict


@dataclass(frozen=True)
class ThirdParty:
    """A library the suite can run: its adapter module and how a user installs it."""

    name: str
    module: str
    library: str
    install: str


@dataclass(frozen=True)
class Deviation:
    """A documented difference between a library and the spec.

    ``name``: its id in docs/third-party.md; ``config``: a config (the
    library's own arguments, imported) on which the library leaves the
    reference's tolerance, or crashes, because of this cause alone, run on
    ``shapes`` (the named cases' shapes when None): the suite's
    ``test_documented_deviation`` checks that it still does, so the
    documentation cannot go stale (None: our importer refuses the library's
    arguments for it, or no config the library runs shows it apart from another
    deviation, and the adapter's own tests demonstrate it); ``tests``:
    fnmatch patterns over the suite's test ids without the backend
    (``"test_named_case_float64[meta_preset]"``) that fail because of it;
    ``cause``: what differs and why, with the pointer into the library's
    source; ``kind``: ``"design"`` (a documented choice of the library) or
    ``"defect"`` (a bug, with its upstream reproduction in docs/third-party.md).
    The drawn configs (``configs()``) leave out exactly the configs a
    deviation covers, and say so where they draw.
    """

    name: str
    config: ShampooConfig | None
    tests: tuple[str, ...]
    cause: str
    kind: Literal["design", "defect"]
    shapes: dict[str, tuple[int, ...]] | None = None

    def covers(self, test_id: str) -> bool:
        """Whether ``test_id`` (backend parameter removed) is one of :attr:`tests`."""
        # "[" opens a character class in fnmatch; here it is the id's own bracket.
        return any(fnmatch.fnmatchcase(test_id, pattern.replace("[", "[[]"))
                   for pattern in self.tests)


#: Meta's snapshot and Google's, as the project's sessions install them.
_SNAPSHOTS = "../shared/thirdparty"

THIRD_PARTY: dict[str, ThirdParty] = {
    "meta": ThirdParty(
        "meta", "shampoo_conformance.thirdparty.meta",
        "torch-shampoo (facebookresearch/optimizers, import distributed_shampoo)",
        "pip install --no-deps --ignore-requires-python "
        "'git+https://github.com/facebookresearch/optimizers.git@f606606' "
        f"(or {_SNAPSHOTS}/torch-shampoo-f606606.tar.gz; "
        "nox -s \"thirdparty(library='meta')\" installs it)",
    ),
    "google": ThirdParty(
        "google", "shampoo_conformance.thirdparty.google",
        "precondition-opt (google-research/precondition, import precondition.distributed_shampoo)",
        "pip install --no-deps "
        "'git+https://github.com/google-research/precondition.git@239a8cd' "
        "chex flax toolz msgpack rich pyyaml "
        f"(or {_SNAPSHOTS}/precondition-239a8cd.tar.gz; "
        "nox -s \"thirdparty(library='google')\" installs it)",
    ),
    "tearfree": ThirdParty(
        "tearfree", "shampoo_conformance.thirdparty.tearfree",
        "precondition-opt (google-research/precondition, import precondition.tearfree)",
        "pip install --no-deps "
        "'git+https://github.com/google-research/precondition.git@239a8cd' "
        "chex flax toolz msgpack rich pyyaml "
        f"(or {_SNAPSHOTS}/precondition-239a8cd.tar.gz; "
        "nox -s \"thirdparty(library='google')\" installs it)",
    ),
    "pytorch-optimizer": ThirdParty(
        "pytorch-optimizer", "shampoo_conformance.thirdparty.pytorch_optimizer",
        "pytorch-optimizer 4.1.0 (kozistr/pytorch_optimizer, its ScalableShampoo)",
        "pip install pytorch-optimizer==4.1.0",
    ),
    "pytorch-optimizer-shampoo": ThirdParty(
        "pytorch-optimizer-shampoo", "shampoo_conformance.thirdparty.pytorch_optimizer_shampoo",
        "pytorch-optimizer 4.1.0 (kozistr/pytorch_optimizer, its plain Shampoo)",
        "pip install pytorch-optimizer==4.1.0",
    ),
    "pytorch-optimizer-soap": ThirdParty(
        "pytorch-optimizer-soap", "shampoo_conformance.thirdparty.pytorch_optimizer_soap",
        "pytorch-optimizer 4.1.0 (kozistr/pytorch_optimizer, its SOAP)",
        "pip install pytorch-optimizer==4.1.0",
    ),
    "heavyball-klshampoo": ThirdParty(
        "heavyball-klshampoo", "shampoo_conformance.thirdparty.heavyball_klshampoo",
        "heavyball 3.2.1 (HomebrewML/HeavyBall, its KLShampoo)",
        "pip install heavyball==3.2.1 opt-einsum",
    ),
    "heavyball-klsoap": ThirdParty(
        "heavyball-klsoap", "shampoo_conformance.thirdparty.heavyball_klsoap",
        "heavyball 3.2.1 (HomebrewML/HeavyBall, its KLSOAP)",
        "pip install heavyball==3.2.1 opt-einsum",
    ),
    "heavyball-muon": ThirdParty(
        "heavyball-muon", "shampoo_conformance.thirdparty.heavyball_muon",
        "heavyball 3.2.1 (HomebrewML/HeavyBall, its Muon)",
        "pip install heavyball==3.2.1 opt-einsum",
    ),
    "torch-muon": ThirdParty(
        "torch-muon", "shampoo_conformance.thirdparty.torch_muon",
        "torch 2.13 (torch.optim.Muon)",
        "pip install torch==2.13.0 (nox -s \"thirdparty(library='torch-optim')\")",
    ),
    "optax-muon": ThirdParty(
        "optax-muon", "shampoo_conformance.thirdparty.optax_muon",
        "optax 0.2.8 (optax.contrib.muon)",
        "pip install optax==0.2.8 (nox -s \"thirdparty(library='optax-contrib')\")",
    ),
    "optax-shampoo": ThirdParty(
        "optax-shampoo", "shampoo_conformance.thirdparty.optax_shampoo",
        "optax-shampoo 0.0.6 (PyPI; Google's distributed_shampoo of 2022, "
        "import optax_shampoo.distributed_shampoo)",
        "pip install --no-deps optax-shampoo==0.0.6 absl-py chex flax toolz msgpack rich "
        "pyyaml (nox -s \"thirdparty(library='optax-shampoo')\" installs it)",
    ),
    "sirfshampoo": ThirdParty(
        "sirfshampoo", "shampoo_conformance.thirdparty.sirfshampoo",
        "sirfshampoo 0.0.1 (PyPI; Lin et al.'s structured inverse- and root-free Shampoo)",
        "pip install --no-deps sirfshampoo==0.0.1 singd==0.0.5 einconv==0.1.0 einops==0.8.2",
    ),
    "heavyball-soap": ThirdParty(
        "heavyball-soap", "shampoo_conformance.thirdparty.heavyball_soap",
        "heavyball 3.2.1 (HomebrewML/HeavyBall, its SOAP)",
        "pip install heavyball==3.2.1 (its dependencies: torch, numpy, opt-einsum; "
        "nox -s \"thirdparty(library='heavyball')\" installs it)",
    ),
}


@dataclass(frozen=True)
class LibraryRun:
    """What a library did in a user's run (``library_run``), seen from the caller.

    ``params``: the parameters after each step, as the library left them (their
    dtype included, not cast); ``grads``: after each step, the gradients the caller
    passed in, as the caller sees them then (``p.grad`` for torch; the arrays given
    to ``update`` for optax).
    """

    params: list[dict[str, np.ndarray]]
    grads: list[dict[str, np.ndarray]]


def deviation_for(deviations: tuple[Deviation, ...], test_id: str) -> Deviation | None:
    """The first of ``deviations`` that covers ``test_id``, or None."""
    return next((d for d in deviations if d.covers(test_id)), None)


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key)


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return _MISSING
        tree = tree[key]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = dict(tree)
    node = out
    for key in path[:-1]:
        child = node.get(key)
        node[key] = dict(child) if isinstance(child, dict) else {}
        node = node[key]
    node[path[-1]] = value
    return out


_MISSING = object()


def nearest_config(backend: object, config: ShampooConfig) -> tuple[ShampooConfig, list[str]]:
    """The config ``backend``'s library runs in place of ``config``, and what changed.

    ``config`` itself where the library expresses it (or the backend is ours);
    else the library's defaults (``base_config()``) with as many of
    ``config``'s values as it can express, taken a section at a time, then
    one value at a time and two at a time (coupled values, such as Meta's one bias-correction
    flag for two sections), until none more fits. The changes, as
    ``config_differences`` lists them, go into the report beside the
    library's numbers, so a comparison never hides that it ran another
    config.
    """
    check = getattr(backend, "expressible", None)
    if not callable(check) or check(config) is None:
        return config, []
    want = config_to_dict(config)
    current = config_to_dict(backend.base_config())  # type: ignore[attr-defined]

    def fits(tree: dict[str, Any]) -> bool:
        try:
            return bool(check(config_from_dict(tree)) is None)
        except ValueError:  # not a valid config on its own
            return False

    # Whole sections first (a graft's type, beta2 and epsilon go together), then
    # single values and pairs of what is left.
    sections: list[tuple[str, ...]] = [
        (key,) for key in want if _get(current, (key,)) != _get(want, (key,))]
    for path in sections:
        trial = _set(current, path, _get(want, path))
        if fits(trial):
            current = trial
    todo = [path for path in _leaves(want) if _get(current, path) != _get(want, path)]

    for size in (1, 2):
        progress = True
        while progress:
            progress = False
            for combo in itertools.combinations(todo, size):
                trial = current
                for leaf in combo:
                    trial = _set(trial, leaf, _get(want, leaf))
                if fits(trial):
                    current, progress = trial, True
                    todo = [path for path in todo if path not in combo]
                    break
    nearest = config_from_dict(current)
    return nearest, config_differences(config, nearest)
