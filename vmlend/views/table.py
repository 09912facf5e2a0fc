"""Plain aligned text tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vmlend.messages import single_line


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table, one line per row: a cell's control characters are escaped
    (``\\n``), so a value from the registry (a VM's name in a hold) cannot forge a row."""
    cells = [[single_line(str(h)) for h in headers]]
    cells += [["" if c is None else single_line(str(c)) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)
