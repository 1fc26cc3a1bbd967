"""The house rules of the source tree (README, "Layout"): every module under
600 lines, no import cycle inside a member package.

An import counts wherever it is written: at module level, inside a function,
or under ``TYPE_CHECKING``, since each one ties the two modules together for
a reader and for the import order. ``from package import name`` counts as an
import of ``package.name`` when that is a module, and of ``package`` (its
``__init__``) otherwise; a package's ``__init__`` re-exporting its own
submodules is not a cycle with them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Every installable member's sources (``<member>/src/<package>``).
PACKAGES = sorted(p for p in ROOT.glob("*/src/*") if (p / "__init__.py").exists())
#: The longest a source module may be.
MAX_LINES = 600


def _module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _imports(path: pathlib.Path, module: str, package: str) -> set[str]:
    """Every module of ``package`` that ``module`` (at ``path``) imports, anywhere in it."""
    found: set[str] = set()
    is_init = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_init else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == package or base.startswith(package + "."):
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == package)
    return found


def import_graph(package: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (its parents and itself aside)."""
    name = package.name
    raw = {
        _module_name(f, package): _imports(f, _module_name(f, package), name)
        for f in package.rglob("*.py")
    }
    return {
        m: {d for d in deps if d in raw and d != m and not m.startswith(d + ".")}
        for m, deps in raw.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One path per strongly connected group of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_rules_see_every_member() -> None:
    assert {p.name for p in PACKAGES} >= {"shampoo_spec", "shampoo_reference"}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_modules_stay_under_the_limit(package: pathlib.Path) -> None:
    long = {
        str(f.relative_to(ROOT)): n
        for f in sorted(package.rglob("*.py"))
        if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_no_import_cycles(package: pathlib.Path) -> None:
    found = cycles(import_graph(package))
    assert not found, "import cycles (every import statement counts): " + "; ".join(
        " <-> ".join(group) for group in found
    )


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert cycles({"p.a": {"p.b"}, "p.b": set()}) == []
