"""The switching chips a path passes, and what each adds to a TLP's one-way latency (pure).

The figures are the SmartIO paper's (§7.1.5): a PEX8733 forwards in at most 132 ns, a PEX8796
in at most 150 ns, a PM8536 (the cluster switch) in about 170 ns, and an NTB crossing adds
about 0.35 µs one way. A route's cost is the sum over its elements. The crossing's figure is the
papers' measurement of the whole crossing, both NTB adapters and the cable, so the adapters are
not costed again; a root complex is not costed (the papers give no figure for it).

Which chip an element has, unless the topology says (``chip = "..."`` on ``[[node.pcie]]`` and
``[[switch]]``): a cluster switch a PM8536, an in-host switch and an expansion chassis' switch
a PEX8796, the two adapters of the transparent link to a chassis a PEX8733 (the adapter-class
chip of the three the papers give).
"""

from __future__ import annotations

import enum


class Chip(enum.StrEnum):
    PEX8733 = "PEX8733"
    PEX8796 = "PEX8796"
    PM8536 = "PM8536"

    @property
    def ns(self) -> int:
        """What the chip adds one way, in nanoseconds."""
        return CHIP_NS[self]


#: One way through each chip (SmartIO §7.1.5; the PEX figures are maxima, the PM8536's typical).
CHIP_NS = {Chip.PEX8733: 132, Chip.PEX8796: 150, Chip.PM8536: 170}

#: One way across one NTB crossing: the two adapters and the cable (about 0.35 µs).
NTB_CROSSING_NS = 350

#: A cluster switch's chip when the topology names none.
CLUSTER_SWITCH_CHIP = Chip.PM8536
#: An in-host PCIe switch's and an expansion chassis switch's chip when the topology names none.
HOST_SWITCH_CHIP = Chip.PEX8796
#: Each of the two adapters of a transparent link to an expansion chassis.
LINK_ADAPTER_CHIP = Chip.PEX8733


def known_chips() -> str:
    """The chips a topology may name, with their figures, for error messages."""
    return ", ".join(f"{c.value} ({c.ns} ns)" for c in Chip)
