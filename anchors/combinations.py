"""Drawn combinations of the anchors' options: pairs and triples, seeded.

Each named case of ``test_meta_library.py`` / ``test_google_library.py`` is one
option set away from a base (Meta: an AdaGrad graft and epsilon 1e-6; Google:
the file's ``BASE`` with an ADAGRAD graft). :func:`inventory` turns the named
cases into that form: an *option* is the set of top-level kwargs a case
changes from the base (``"precondition_frequency+start_preconditioning_step"``),
its *values* the fragments the cases set it to (:data:`REMOVE` where a case
drops a base key, e.g. ``no_graft``). :func:`draw` then picks, for seed ``s``,
2 or 3 options with disjoint keys and one value of each, and lays their
fragments over the base: a kwargs set the named cases never ran together.

The library's own validation decides whether a drawn set is valid: the test
builds (and runs) the library on it and skips the draw if the library refuses
it (a skip, counted, not a failure); a set the library accepts and our importer
refuses fails, as a finding. A drawn set then runs through the same side-by-side
comparison, at the same tolerance, as a named case.

Profiles: ``ANCHORS_DRAWS`` draws per library, seeds ``ANCHORS_SEED`` (default
0) onward. Unset: the short CI profile (:data:`CI_DRAWS`). The deep one::

    ANCHORS_DRAWS=200 nox -s "anchors(library='meta')" -- -k combination
    ANCHORS_DRAWS=200 nox -s "anchors(library='google')" -- -k combination

Each draw's test id is ``s<seed>-<the drawn kwargs, JSON>`` (over the base; the
whole kwargs are printed too), so ``ANCHORS_SEED=17 ANCHORS_DRAWS=1`` reruns one.
A gap a draw finds becomes a named case in the library's file.
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Callable, Mapping
from typing import Any

#: A fragment value meaning "this base key is removed" (``no_graft``).
REMOVE = "<removed>"

#: Draws per library in CI (``ANCHORS_DRAWS`` unset): kept to ~20-30 s each on 2 cores
#: (Meta ~1.1 s a draw, Google ~4 s: two XLA compiles).
CI_DRAWS = {"meta": 12, "google": 6}


def draw_count(library: str) -> int:
    value = os.environ.get("ANCHORS_DRAWS")
    return int(value) if value else CI_DRAWS[library]


def first_seed() -> int:
    return int(os.environ.get("ANCHORS_SEED", "0"))


Option = tuple[str, ...]  # the sorted top-level keys a fragment sets
Inventory = dict[Option, list[dict[str, Any]]]


def _canonical(value: Any) -> str:
    """A stable text for a fragment value (callables by name): dedup and test ids."""

    def default(obj: Any) -> str:
        return getattr(obj, "__name__", None) or type(obj).__name__

    return json.dumps(value, sort_keys=True, default=default, separators=(",", ":"))


def inventory(base: Mapping[str, Any], cases: Mapping[str, Mapping[str, Any]]) -> Inventory:
    """Option -> distinct values, from each case's difference to ``base``."""
    out: Inventory = {}
    seen: set[str] = set()
    for name in sorted(cases):
        case = cases[name]  # a base key the case lacks: REMOVE (the library's default)
        fragment = {k: v for k, v in case.items() if k not in base or base[k] != v}
        fragment.update({k: REMOVE for k in base if k not in case})
        if not fragment:
            continue
        key = _canonical(fragment)
        if key in seen:
            continue
        seen.add(key)
        out.setdefault(tuple(sorted(fragment)), []).append(fragment)
    return out


def inventory_size(inv: Inventory) -> tuple[int, int]:
    """(options, values)."""
    return len(inv), sum(len(v) for v in inv.values())


def pick(seed: int, inv: Inventory) -> list[tuple[Option, int]]:
    """Seed ``seed``'s choice: 2 or 3 options with disjoint keys, and a value index of each."""
    rng = random.Random(f"anchors-combinations-{seed}")
    want = rng.choice((2, 3))
    options = sorted(inv)
    rng.shuffle(options)
    chosen: list[Option] = []
    used: set[str] = set()
    for option in options:
        if used.isdisjoint(option):
            chosen.append(option)
            used.update(option)
        if len(chosen) == want:
            break
    return [(option, rng.randrange(len(inv[option]))) for option in sorted(chosen)]


def draw(seed: int, base: Mapping[str, Any],
         inv: Inventory) -> tuple[dict[str, Any], dict[str, Any]]:
    """Seed ``seed``'s kwargs (:func:`pick`'s values over ``base``), and the drawn
    fragments merged (what differs from ``base``: the test id)."""
    drawn: dict[str, Any] = {}
    for option, index in pick(seed, inv):
        drawn.update(inv[option][index])
    kwargs = copy.deepcopy(dict(base))
    for key, value in drawn.items():
        if value == REMOVE:
            kwargs.pop(key, None)
        else:
            kwargs[key] = copy.deepcopy(value)
    return kwargs, drawn


def describe(kwargs: Mapping[str, Any]) -> str:
    """The kwargs as one line of JSON (callables by name): printed with every draw."""
    return _canonical(kwargs)


Draw = tuple[int, dict[str, Any], str, str | None]


def draws(library: str, base: Mapping[str, Any], inv: Inventory,
          known: Callable[[Mapping[str, Any]], str | None]) -> list[Draw]:
    """(seed, kwargs, test id, known-gap reason or None) of this profile's draws."""
    out = []
    start = first_seed()
    for seed in range(start, start + draw_count(library)):
        kwargs, drawn = draw(seed, base, inv)
        out.append((seed, kwargs, f"s{seed}-{_canonical(drawn)}", known(kwargs)))
    return out
