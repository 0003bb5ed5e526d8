"""The tables the benchmarks print: markdown for docs/BENCHMARKS.md and issue notes, aligned plain text
for a terminal."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence


def markdown_row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def markdown_rule(columns: int, right: Collection[int] = ()) -> str:
    """The line under a markdown header; the columns numbered in `right` are right-aligned."""
    return markdown_row("---:" if i in right else "---" for i in range(columns))


def markdown_table(header: Sequence[str], rows: Iterable[Iterable[object]], right: Collection[int] = ()) -> str:
    return "\n".join([markdown_row(header), markdown_rule(len(header), right), *map(markdown_row, rows)])


def aligned(rows: list[list[str]]) -> str:
    """Plain-text columns, each right-aligned to its widest cell; the first row is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
