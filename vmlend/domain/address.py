"""A guest PCI address (``DDDD:BB:SS.F``), as libvirt writes it in ``<address type='pci'>``."""

from __future__ import annotations

import re

import msgspec

from vmlend.errors import ConfigError

_BDF = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,4}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
    r"(?P<slot>[0-9a-fA-F]{1,2})\.(?P<function>[0-7])$"
)


class PciAddress(msgspec.Struct, frozen=True, order=True):
    domain: int
    bus: int
    slot: int
    function: int

    def __post_init__(self) -> None:
        limits = (("domain", 0xFFFF), ("bus", 0xFF), ("slot", 0x1F), ("function", 7))
        for name, limit in limits:
            value = getattr(self, name)
            if not 0 <= value <= limit:
                raise ConfigError(f"bad guest PCI address: {name} {value:#x} exceeds {limit:#x}")

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        """``0000:00:05.0`` or ``00:05.0`` (domain 0)."""
        m = _BDF.match(text.strip())
        if not m:
            raise ConfigError(
                f"bad guest PCI address {text!r}: expected DDDD:BB:SS.F such as 0000:00:05.0"
            )
        return cls(
            domain=int(m.group("domain") or "0", 16),
            bus=int(m.group("bus"), 16),
            slot=int(m.group("slot"), 16),
            function=int(m.group("function"), 16),
        )

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"
