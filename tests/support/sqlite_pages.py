"""Damage given pages of an SQLite file the way a bad disk would: tests of what the state's
open and reads refuse (``vmlend.registry.store``)."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def pages_of(path: Path, name: str) -> list[int]:
    """The page numbers of table or index ``name`` (its b-tree and overflow pages), in order."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT pageno FROM dbstat WHERE name = ? ORDER BY pageno", (name,))
        return [r[0] for r in rows]
    finally:
        conn.close()


def overflow_pages_of(path: Path, name: str) -> list[int]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'overflow' ORDER BY pageno",
            (name,),
        )
        return [r[0] for r in rows]
    finally:
        conn.close()


def smash(path: Path, pages: list[int], *, keep: int = 0) -> bytes:
    """Overwrite ``pages`` with 0xa5 bytes, all but their first ``keep`` bytes (4: an overflow
    page's link to the next one); the file's new content."""
    conn = sqlite3.connect(path)
    try:
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the file itself
    finally:
        conn.close()
    data = bytearray(path.read_bytes())
    for page in pages:
        start = (page - 1) * size + keep
        data[start : page * size] = b"\xa5" * (size - keep)
    path.write_bytes(bytes(data))
    return bytes(data)
