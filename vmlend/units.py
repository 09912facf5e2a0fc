"""Byte sizes as people read and write them: the one place that formats a size, and the CLI's
``4G`` notation back to bytes.

Two forms, for two jobs:

- ``format_size_exact``: the largest binary unit that divides the size, ``4G``, ``16M``,
  ``1000B``; exact, so ``parse_size`` reads it back (tables, domain XML metadata).
- ``format_size_human``: two decimals in the largest unit not above it, ``32.05 GiB``,
  ``512 bytes``; for messages about amounts that need not be round (free window room).
"""

from __future__ import annotations

import re

from vmlend.errors import ConfigError

_UNITS = (("T", 40), ("G", 30), ("M", 20), ("K", 10))

# The CLI follows QEMU's -m and virsh: a bare suffix is binary (4G = 4 GiB).
_CLI_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


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


def parse_size(text: str) -> int:
    """``4G``, ``512M``, ``1048576k``, ``4GiB`` -> bytes (binary multiples)."""
    m = _CLI_SIZE.match(text)
    if not m:
        raise ConfigError(f"bad size {text!r}: expected a number with a unit such as 512M or 4G")
    number = int(m.group(1))
    suffix = (m.group(2) or "b").lower()
    scale = 1 if suffix == "b" else 1 << (10 * "kmgt".index(suffix[0]) + 10)
    return number * scale
