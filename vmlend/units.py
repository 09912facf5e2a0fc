"""Byte sizes as people read them: the one place that formats a size. A leaf: it imports
nothing of vmlend, so every layer (``errors`` too) can use it.

Two forms, for two jobs:

- ``format_size_exact``: the largest binary unit that divides the size, ``4G``, ``16M``,
  ``1000B``; exact, so ``vmlend.domain.units.parse_size`` reads it back (tables, domain XML
  metadata).
- ``format_size_human``: two decimals in the largest unit not above it, ``32.05 GiB``,
  ``512 bytes``; for messages about amounts that need not be round (free window room).
"""

from __future__ import annotations

_UNITS = (("T", 40), ("G", 30), ("M", 20), ("K", 10))


def format_size_exact(size: int) -> str:
    """Largest binary unit that divides ``size`` exactly: 4294967296 -> '4G', 1000 -> '1000B'."""
    for suffix, shift in _UNITS:
        if size and size % (1 << shift) == 0:
            return f"{size >> shift}{suffix}"
    return f"{size}B"


def format_size_human(size: int) -> str:
    """Bytes in binary units: ``64 GiB``, ``32.05 GiB``, ``16 MiB``, ``512 bytes``."""
    for prefix, shift in _UNITS:
        if size >= 1 << shift:
            value = f"{size / (1 << shift):.2f}".rstrip("0").rstrip(".")
            return f"{value} {prefix}iB"
    return f"{size} bytes"
