"""libvirt's scaled memory sizes (a value and its ``unit`` attribute) to bytes; the CLI's ``4G``
notation and every size formatter are in ``vmlend.units``."""

from __future__ import annotations

from vmlend.errors import DomainXMLError

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
