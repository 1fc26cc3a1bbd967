"""Every ```python block of the guide pages runs, in order, as a reader would paste it.

Convention (stated in docs/index.md's "About these pages"): on the pages in
:data:`PAGES`, every fenced block whose info string is exactly ``python``
is an executable example. The blocks of one page run in order in one fresh
interpreter (a subprocess, so a page that enables 64-bit JAX or sets torch
threads cannot leak into another page), in a temporary working directory
(checkpoints land there). A block that must not run (an API still being
designed, a sketch) is preceded by the line ``<!-- no-test: REASON -->``;
the reason is required. Other languages (``bash``, ``text``) never run.

A page whose examples import a framework that is not installed is skipped,
not failed, so the test runs in any environment that has the spec.

The examples assert what they claim (a test accuracy, a loss that went down,
a config field), so a run that silently does nothing fails here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1]
#: Pages whose ```python blocks are examples that must run.
PAGES = (
    "index.md",
    "quickstart-torch.md",
    "quickstart-jax.md",
    "migrating.md",
    "choosing-a-backend.md",
    "tuning.md",
    "distributed.md",
    "integrations.md",
)
#: Seconds one page may take (the slowest, the JAX quickstart, compiles twice).
PAGE_TIMEOUT_S = 300

_FENCE_OPEN = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_NO_TEST = re.compile(r"^\s*<!--\s*no-test:\s*(?P<reason>\S.*?)\s*-->\s*$")
#: XLA options of the nox `tests` session for compiled examples (unless XLA_FLAGS is set).
JAX_TEST_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
#: Top-level modules whose absence skips a page, by the import that needs them.
_FRAMEWORKS = ("torch", "jax", "optax", "sklearn", "lightning", "accelerate", "flax", "orbax")


@dataclass(frozen=True)
class Block:
    """One fenced block: its 1-based first code line, info string, code and skip reason."""

    line: int
    info: str
    code: str
    skip_reason: str | None


def extract_blocks(text: str) -> list[Block]:
    """Fenced code blocks of a Markdown page, indentation (lists, admonitions) removed.

    A fence closes at a line of the same fence characters, at least as long,
    with nothing after them (CommonMark). ``<!-- no-test: REASON -->`` on the
    last non-blank line before the opening fence marks the block skipped.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE_OPEN.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, fence = match["indent"], match["fence"]
        info = match["info"].strip()
        previous = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
        skip = _NO_TEST.match(previous)
        closing = re.compile(rf"^[ ]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"line {i + 1}: fence {fence!r} is never closed")
        code = textwrap.dedent("\n".join(body)) + "\n"
        blocks.append(Block(i + 2, info, code, skip["reason"] if skip else None))
        i = j + 1
    return blocks


def python_blocks(page: str) -> list[Block]:
    return [b for b in extract_blocks((DOCS / page).read_text()) if b.info == "python"]


def _frameworks(blocks: list[Block]) -> set[str]:
    """Frameworks the runnable blocks import (``import x`` / ``from x... import``)."""
    wanted = set()
    for block in blocks:
        for name in _FRAMEWORKS:
            if re.search(rf"^\s*(import|from)\s+{name}\b", block.code, re.MULTILINE):
                wanted.add(name)
        if re.search(r"^\s*(import|from)\s+shampoo_torch\b", block.code, re.MULTILINE):
            wanted.add("torch")
        if re.search(r"^\s*(import|from)\s+shampoo_jax\b", block.code, re.MULTILINE):
            wanted.update({"jax", "optax"})
    return wanted


#: Runs the blocks of one page; each compiled with its page and line as the file name,
#: so a traceback points at the Markdown line that failed.
_RUNNER = """
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for block in blocks:
    source = "\\n" * (block["line"] - 1) + block["code"]
    exec(compile(source, block["page"], "exec"), namespace)
"""


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page: str, tmp_path: Path) -> None:
    blocks = [b for b in python_blocks(page) if b.skip_reason is None]
    if not blocks:
        pytest.skip(f"{page} has no runnable python block")
    for name in sorted(_frameworks(blocks)):
        pytest.importorskip(name)
    payload = [{"page": str(DOCS / page), "line": b.line, "code": b.code} for b in blocks]
    (tmp_path / "blocks.json").write_text(json.dumps(payload))
    (tmp_path / "runner.py").write_text(_RUNNER)
    env = {
        **os.environ,
        # jaxlib 0.10.2's CPU eigh can deadlock against a threaded OpenBLAS (docs/results.md).
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1"),
        # Faster XLA CPU compiles (the examples are tiny), as in noxfile.JAX_TEST_FLAGS.
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", JAX_TEST_FLAGS),
    }
    result = subprocess.run(
        [sys.executable, "runner.py", "blocks.json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=PAGE_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"an example on {page} failed (traceback lines are lines of {page}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )


@pytest.mark.parametrize("page", PAGES)
def test_skipped_blocks_say_why_and_pages_have_examples(page: str) -> None:
    blocks = extract_blocks((DOCS / page).read_text())
    marked = sum(bool(_NO_TEST.match(ln)) for ln in (DOCS / page).read_text().splitlines())
    skipped = [b for b in blocks if b.skip_reason is not None]
    # Every no-test marker sits right before a block (a stray one would silently do nothing).
    assert len(skipped) == marked, f"{page}: {marked} no-test markers, {len(skipped)} on blocks"
    assert all(b.info == "python" for b in skipped), f"{page}: no-test on a non-python block"
    if page.startswith("quickstart") or page == "migrating.md":
        assert any(b.info == "python" and b.skip_reason is None for b in blocks), page


def test_extractor_reads_indented_fences_and_markers() -> None:
    text = textwrap.dedent(
        """\
        Intro.

        ```python
        x = 1
        ```

        - a list item:

            ```python
            if x:
                y = 2
            ```

        <!-- no-test: needs the future API -->
        ```python
        future()
        ```

        ````text
        ```python
        not a block of its own
        ```
        ````
        """
    )
    blocks = extract_blocks(text)
    assert [(b.line, b.info, b.skip_reason) for b in blocks] == [
        (4, "python", None),
        (10, "python", None),
        (16, "python", "needs the future API"),
        (20, "text", None),
    ]
    assert blocks[1].code == "if x:\n    y = 2\n"
    assert "not a block of its own" in blocks[3].code
    with pytest.raises(ValueError, match="never closed"):
        extract_blocks("```python\nx = 1\n")
