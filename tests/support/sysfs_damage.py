"""Damage a fake sysfs the ways a broken driver or a stray file could: the helpers plant, in
place of one attribute, other bytes, a directory, a symbolic link loop or a FIFO. Used by the
direct tests of item 7 and by the fuzz suite."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

#: Every attribute of a SmartIO device directory (docs/smartio-contract.md section 2).
SMARTIO_ATTRIBUTES = (
    "fdid",
    "lender_node_id",
    "lender_adapter",
    "lender_bdf",
    "vendor",
    "device",
    "class",
    "dma_bits",
    "physfn",
    "bars",
    "availability",
    "borrower_node_id",
)


def _clear(path: Path) -> None:
    if path.is_symlink() or path.is_file() or path.is_fifo():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def plant_bytes(path: Path, data: bytes) -> None:
    _clear(path)
    path.write_bytes(data)


def plant_directory(path: Path) -> None:
    _clear(path)
    path.mkdir()
    (path / "value").write_text("1\n")


def plant_loop(path: Path) -> None:
    """``path`` -> ``path.loop`` -> ``path``: resolving either never ends."""
    _clear(path)
    other = path.with_name(path.name + ".loop")
    _clear(other)
    other.symlink_to(path.name)
    path.symlink_to(other.name)


def plant_fifo(path: Path) -> None:
    _clear(path)
    os.mkfifo(path)
