"""The lender side of the agent: take back the devices this node lends whose holder's lease
ended (DESIGN: a vanished hold leaves a fence that only the lender removes, after it has
unmapped and reset the device, carrying the fence's token so that a newer holder's borrow is
never ended by a late take-back)."""

from __future__ import annotations

import logging

from vmlend.agent.trouble import Trouble
from vmlend.errors import StateError, VmlendError
from vmlend.fabric.base import TakesBack
from vmlend.topology.model import format_fdid

log = logging.getLogger(__name__)


def take_back_fenced(fabric: TakesBack, trouble: Trouble | None = None) -> list[int]:
    """One scan: take back every fenced device of this node; the fdids taken back. One that
    fails does not hold up the others (it is tried again on the next scan)."""
    trouble = trouble or Trouble(log, "looking for fenced devices")
    try:
        fences = fabric.fenced()
    except StateError as e:
        trouble.failed(e)
        return []
    trouble.cleared()
    taken = []
    for fence in fences:
        try:
            if fabric.take_back(fence):
                taken.append(fence.fdid)
                log.info(
                    "took back device %s from %s/%s (its lease ended)",
                    format_fdid(fence.fdid),
                    fence.holder.node,
                    fence.holder.vm,
                )
        except VmlendError as e:
            log.warning("cannot take back device %s: %s", format_fdid(fence.fdid), e)
    return taken
