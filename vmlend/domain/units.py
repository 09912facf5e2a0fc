"""Sizes: libvirt's ``unit`` attribute and the CLI's ``4G`` notation, both to bytes (sizes are
formatted by ``vmlend.units``)."""

from __future__ import annotations

import re

from vmlend.errors import ConfigError, DomainXMLError
from vmlend.units import format_size_human

#: The largest size vmlend takes, 2^52 bytes (4096 TiB): x86's physical address limit, so no
#: guest's memory nor any window is larger. A bigger number is a typo or an attack, never RAM.
MAX_SIZE = 1 << 52

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

# vmlend's own compact form (``vmlend.units.format_size_exact``: 16M, 1000B), read back from
# its metadata: a bare suffix is binary.
# ASCII only: \d would take any script's digits ('४G') and int() would read them.
_EXACT_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE | re.ASCII)

# The command line speaks libvirt's units (KiB/MiB/GiB and k/M/G binary, KB/MB/GB decimal)
# and reads a bare number as MiB, as virt-install's --memory does.
_CLI_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE | re.ASCII)


def _within_limit(size: int, text: str, error: type[ConfigError], limit: int = MAX_SIZE) -> int:
    if size > limit:
        raise error(
            f"size {text!r} is more than {format_size_human(limit)}, the most a host can"
            " address; check the number and its unit"
        )
    return size


def libvirt_bytes(value: str, unit: str | None, *, default_unit: str = "KiB") -> int:
    """The byte count of a libvirt memory element's text and ``unit`` attribute."""
    scale = _LIBVIRT_UNITS.get((unit or default_unit).lower())
    if scale is None:
        raise DomainXMLError(f"unknown memory unit {unit!r}")
    digits = value.strip()
    if digits.startswith("-") and digits[1:].isdigit():
        raise DomainXMLError(f"memory value {value!r} is negative")
    if not (digits.isascii() and digits.isdigit()):  # int() takes '१६' and '1_0'
        raise DomainXMLError(f"memory value {value!r} is not an integer in ASCII digits")
    size = int(digits) * scale
    return _within_limit(size, f"{digits} {unit or default_unit}", DomainXMLError)


def parse_cli_size(text: str, *, limit: int | None = MAX_SIZE) -> int:
    """A size on the command line -> bytes: ``512`` (MiB), ``4G``/``4GiB`` (binary), ``4GB``
    (decimal, 4*10^9), ``1048576k``, ``4096B``; at most ``limit`` (default: memory's
    ``MAX_SIZE``; None: a storage size, which its caller bounds by its block count)."""
    m = _CLI_SIZE.match(text)
    if not m:
        raise ConfigError(
            f"bad size {text!r}: expected a number, in MiB, or with a unit such as 512M,"
            " 4GiB or 4GB (decimal)"
        )
    unit = m.group(2)
    scale = _LIBVIRT_UNITS.get(unit.lower()) if unit else 1 << 20
    if scale is None:
        raise ConfigError(
            f"bad size {text!r}: unknown unit {unit!r} (use libvirt's: B, KiB, MiB, GiB, TiB"
            " or k, M, G, T, binary; KB, MB, GB, TB, decimal)"
        )
    size = int(m.group(1)) * scale
    return size if limit is None else _within_limit(size, text, ConfigError, limit)


def parse_size(text: str, *, limit: int | None = MAX_SIZE) -> int:
    """vmlend's compact form back to bytes: ``16M``, ``1000B``, ``4GiB`` (binary multiples);
    at most ``limit`` (as ``parse_cli_size``)."""
    m = _EXACT_SIZE.match(text)
    if not m:
        raise ConfigError(f"bad size {text!r}: expected a number with a unit such as 512M or 4G")
    number = int(m.group(1))
    suffix = (m.group(2) or "b").lower()
    scale = 1 if suffix == "b" else 1 << (10 * "kmgt".index(suffix[0]) + 10)
    size = number * scale
    return size if limit is None else _within_limit(size, text, ConfigError, limit)
