"""The rows as markdown: a table per model and block size, and the summary
docs/scaling.md shows."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from shampoo_conformance.studies.scaling.models import MODELS, DecoderShapes
from shampoo_conformance.studies.scaling.rows import BLOCK_SIZES, SHARD_GROUPS, scaling_rows


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _bytes(x: float) -> str:
    for scale, prefix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= scale:
            return f"{x / scale:.3g} {prefix}"
    return f"{x:.0f} B"


def cell(x: object) -> float:
    """The number in a row's cell (a float, or its text when the rows were read from the CSV)."""
    return float(str(x))


def _fixed(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


MARKDOWN_HEADER = ("| mode | N | blocks | root max | root max/mean | LPT root alone | step max "
                   "| step max/mean | factor memory max | memory max/mean | comm per step max "
                   "| pieces max | where the imbalance comes from |")


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    """The rows as a markdown table (units: flop, bytes in binary prefixes)."""
    lines = [MARKDOWN_HEADER, "|" + "---|" * (MARKDOWN_HEADER.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['world']} | {r['blocks']} | {_si(cell(r['root_max']), 'flop')} "
            f"| {cell(r['root_imbalance']):.2f} | {_fixed(cell(r['root_lpt_imbalance']))} "
            f"| {_si(cell(r['step_max']), 'flop')} | {cell(r['step_imbalance']):.2f} "
            f"| {_bytes(cell(r['memory_max_bytes']))} | {cell(r['memory_imbalance']):.2f} "
            f"| {_bytes(cell(r['comm_max_bytes']))} "
            f"| {r['pieces_max'] if str(r['mode']) not in ('ddp', 'local') else '-'} "
            f"| {r['cause']} |"
        )
    return "\n".join(lines)


#: World sizes of the summary tables (docs/scaling.md).
SUMMARY_WORLDS = (8, 64, 512, 4096)
#: Block size of the summary's per-mode tables and of the plot.
SUMMARY_BLOCK_SIZE = 1024


def block_size_table(rows: Sequence[dict[str, object]], world: int) -> str:
    """At one world size, per model and block size: what the block size changes."""
    header = ("| model | block size | blocks | idle ranks | root max (ddp, lossless) "
              "| root max/mean | LPT root alone | factor memory max | comm max, lossless "
              "| comm max, ddp | root max, local | factor memory max, local |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    pick = {(r["model"], int(str(r["block_size"])), r["mode"]): r
            for r in rows if int(str(r["world"])) == world}
    for model, bs in sorted({(m, b) for m, b, _ in pick}, key=lambda k: (str(k[0]), k[1])):
        ddp, lossless, local = (pick.get((model, bs, m)) for m in ("ddp", "lossless", "local"))
        if ddp is None or lossless is None or local is None:
            continue
        lines.append(
            f"| {model} | {bs} | {ddp['blocks']} | {ddp['idle_ranks']} "
            f"| {_si(cell(ddp['root_max']), 'flop')} "
            f"| {cell(ddp['root_imbalance']):.2f} "
            f"| {_fixed(cell(ddp['root_lpt_imbalance']))} "
            f"| {_bytes(cell(ddp['memory_max_bytes']))} "
            f"| {_bytes(cell(lossless['comm_max_bytes']))} "
            f"| {_bytes(cell(ddp['comm_max_bytes']))} "
            f"| {_si(cell(local['root_max']), 'flop')} "
            f"| {_bytes(cell(local['memory_max_bytes']))} |"
        )
    return "\n".join(lines)


def summary_tables(rows: Sequence[dict[str, object]]) -> list[tuple[str, str]]:
    """``(title, markdown table)``: docs/scaling.md's tables, computed from ``rows``.

    Per model, every mode at :data:`SUMMARY_WORLDS` with block size
    :data:`SUMMARY_BLOCK_SIZE`; then every block size at the largest world size.
    """
    out = []
    for model in sorted({str(r["model"]) for r in rows}):
        sub = [r for r in rows if r["model"] == model
               and int(str(r["block_size"])) == SUMMARY_BLOCK_SIZE
               and int(str(r["world"])) in SUMMARY_WORLDS]
        if sub:
            out.append((f"{model}, block size {SUMMARY_BLOCK_SIZE}", markdown_table(sub)))
    worlds = [int(str(r["world"])) for r in rows]
    if worlds:
        out.append((f"Block size at N = {max(worlds)}", block_size_table(rows, max(worlds))))
    return out


def summary_rows(models: Iterable[DecoderShapes] = MODELS.values()) -> list[dict[str, object]]:
    """Only the rows :func:`summary_tables` reads (what docs/scaling.md shows)."""
    models = list(models)
    rows = scaling_rows(models, [SUMMARY_BLOCK_SIZE], SUMMARY_WORLDS, SHARD_GROUPS)
    others = [b for b in BLOCK_SIZES if b != SUMMARY_BLOCK_SIZE]
    return rows + scaling_rows(models, others, [max(SUMMARY_WORLDS)], SHARD_GROUPS)
