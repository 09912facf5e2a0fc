"""``SimFabric``: the simulated SmartIO cluster's fabric, the ledger with simulated hardware.

The bookkeeping is the production ledger's (``vmlend.ledger.ledger``); what makes it the
simulator is the ``hardware`` it is given (``vmlend.sim.hardware.SimHardware``: LUT entries,
IOMMU domains, NTB segments), which the ledger's borrow, give-back and take-back drive. Without
hardware (the hook on the ``sim`` backend) it is the ledger alone: the simulated hardware of
a node lives in that node's hypervisor process.
"""

from __future__ import annotations

from vmlend.ledger.ledger import MDEV_TYPE, Ledger, parent_name

__all__ = ["MDEV_TYPE", "SimFabric", "parent_name"]


class SimFabric(Ledger):
    """The fabric of the simulated cluster (see the module's docstring)."""
