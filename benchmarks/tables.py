"""Markdown tables, as every benchmark script prints its results."""

from __future__ import annotations

import sys


def format_value(value: object) -> str:
    """A table cell: floats to 3 significant digits (whole numbers at 100 and above), nan as n/a."""
    if isinstance(value, float):
        if value != value:  # nan
            return "n/a"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(title: str, columns: list[str], rows: list[list[object]]) -> None:
    """Print a Markdown table under a ``### title`` line (floats to 3 significant digits)."""
    cells = [columns] + [[format_value(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |"

    print(f"\n### {title}\n")
    print(line(columns))
    print("|" + "|".join("-" * (width + 2) for width in widths) + "|")
    for row in cells[1:]:
        print(line(row))
    sys.stdout.flush()
