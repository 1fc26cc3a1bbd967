"""docs/third-party.md says what the code checks: every deviation of every third-party
backend (its adapter's ``DEVIATIONS``) is a row of the deviation table in that
backend's section, with the same kind, and every row there is one of them.

A backend whose library is not installed skips (the test runs in each library's
``thirdparty`` session and in ``libraries``)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from shampoo_conformance.thirdparty.registry import THIRD_PARTY

PAGE = Path(__file__).resolve().parents[2] / "docs" / "third-party.md"

#: Each backend's section heading (its start), which deviation table of the section is
#: its own (None: it has none), and the column of a shared table that marks its rows.
SECTIONS: dict[str, tuple[str, int | None, str | None]] = {
    "meta": ("## Meta:", 0, None),
    "google": ("## Google (`precondition.distributed_shampoo`)", 0, None),
    "tearfree": ("## Google (`precondition.tearfree`)", 0, None),
    "optax-shampoo": ("## optax-shampoo", 0, None),
    "pytorch-optimizer": ("### `pytorch-optimizer`: `ScalableShampoo`", 0, None),
    "pytorch-optimizer-shampoo": ("### `pytorch-optimizer-shampoo`: `Shampoo`", 0, None),
    "pytorch-optimizer-soap": ("## SOAP:", 0, "pytorch-optimizer"),
    "heavyball-soap": ("## SOAP:", 0, "heavyball"),
    "heavyball-klshampoo": ("## heavyball 3.2.1: `KLShampoo`", 0, None),
    "heavyball-klsoap": ("## heavyball 3.2.1: `KLShampoo`", 1, None),
    "sirfshampoo": ("## sirfshampoo", None, None),
    "torch-muon": ("### `torch-muon`", 0, None),
    "optax-muon": ("### `optax-muon`", 0, None),
    "heavyball-muon": ("### `heavyball-muon`", 0, None),
}
#: Rows of a section that are no adapter deviation: Meta's two found by the anchors
#: tests on the real library (anchors/test_meta_library.py), which no suite config shows.
ANCHORS_ONLY = {"meta": {"float32_averaging_scalars", "eval_mode_step_mutates_state"}}


def _section(lines: list[str], prefix: str) -> list[str]:
    starts = [i for i, line in enumerate(lines) if line.startswith(prefix)]
    assert len(starts) == 1, f"docs/third-party.md: {len(starts)} headings start {prefix!r}"
    start = starts[0]
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    fenced = False
    for i in range(start + 1, len(lines)):
        if lines[i].lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(rf"^#{{1,{level}}} ", lines[i]):
            return lines[start:i]
    return lines[start:]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _deviation_tables(lines: list[str]) -> list[list[str]]:
    tables, current = [], []
    for line in [*lines, ""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return [t for t in tables if _cells(t[0])[0] == "Deviation"]


def _rows(backend: str) -> dict[str, str]:
    """The deviation rows of ``backend``'s section: name -> kind cell."""
    prefix, which, column = SECTIONS[backend]
    if which is None:
        return {}
    table = _deviation_tables(_section(PAGE.read_text().splitlines(), prefix))[which]
    header = [h.lower() for h in _cells(table[0])]
    kind = header.index("kind")
    mine = header.index(column.lower()) if column else None
    rows = {}
    for line in table[2:]:
        cells = _cells(line)
        name = re.fullmatch(r"`([a-z0-9_]+)`", cells[0])
        assert name, f"{backend}: a deviation row without a `name`: {line[:80]}"
        if mine is None or not cells[mine].startswith("-"):
            rows[name.group(1)] = cells[kind]
    return rows


def test_every_backend_has_a_section() -> None:
    assert sorted(SECTIONS) == sorted(THIRD_PARTY)


@pytest.mark.parametrize("name", sorted(THIRD_PARTY))
def test_deviations_are_the_page_rows(name: str) -> None:
    # Not "backend": the suite's plugin parametrizes that name (--backend).
    try:
        module = importlib.import_module(THIRD_PARTY[name].module)
    except ImportError as err:
        pytest.skip(f"{name}: its library is not installed ({err})")
    code = {d.name: d.kind for d in module.DEVIATIONS}
    page = _rows(name)
    missing = sorted(set(code) - set(page))
    assert not missing, f"{name}: DEVIATIONS without a row in docs/third-party.md: {missing}"
    wrong = {n: (k, page[n]) for n, k in code.items() if not page[n].startswith(k)}
    assert not wrong, f"{name}: kind in the code vs on the page: {wrong}"
    extra = sorted(set(page) - set(code) - ANCHORS_ONLY.get(name, set()))
    assert not extra, f"{name}: rows in docs/third-party.md no DEVIATIONS has: {extra}"
