"""Sizes: libvirt's ``unit`` attribute and the CLI's ``4G`` notation, both to bytes (sizes are
formatted by ``vmlend.units``)."""

from __future__ import annotations

import re

from vmlend.errors import ConfigError, DomainXMLError

# libvirt's scaled integers (formatdomain: "Memory Allocation"): k/M/G/T and their *iB spellings
# are powers of 1024, KB/MB/GB/TB powers of 1000. No unit means KiB for <memory>.
_LIBVIRT_UNITS = {
    "b": 1,
    "bytes": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
    "p": 1 << 50,
    "pib": 1 << 50,
    "pb": 10**15,
    "e": 1 << 60,
    "eib": 1 << 60,
    "eb": 10**18,
}

# The CLI follows QEMU's -m and virsh: a bare suffix is binary (4G = 4 GiB).
_CLI_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def libvirt_bytes(value: str, unit: str | None, *, default_unit: str = "KiB") -> int:
    """The byte count of a libvirt memory element's text and ``unit`` attribute."""
    scale = _LIBVIRT_UNITS.get((unit or default_unit).lower())
    if scale is None:
        raise DomainXMLError(f"unknown memory unit {unit!r}")
    try:
        number = int(value.strip(), 10)
    except ValueError:
        raise DomainXMLError(f"memory value {value!r} is not an integer") from None
    if number < 0:
        raise DomainXMLError(f"memory value {value!r} is negative")
    return number * scale


def parse_size(text: str) -> int:
    """``4G``, ``512M``, ``1048576k``, ``4GiB`` -> bytes (binary multiples)."""
    m = _CLI_SIZE.match(text)
    if not m:
        raise ConfigError(f"bad size {text!r}: expected a number with a unit such as 512M or 4G")
    number = int(m.group(1))
    suffix = (m.group(2) or "b").lower()
    scale = 1 if suffix == "b" else 1 << (10 * "kmgt".index(suffix[0]) + 10)
    return number * scale
