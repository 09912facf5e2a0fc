"""The registry's invariants around a hot migration on the CLI's simulated nodes, whose hardware
runs in no test process (``vmlend.sim.invariants`` checks the hardware where it does): run
after every step of a move. No tests here."""

from __future__ import annotations

from collections.abc import Collection

from vmlend.ledger.handover_record import KIND
from vmlend.ledger.nvmeshares import SHARE_RECORD
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.registry import Registry
from vmlend.sim.register import LenderRegister, borrower_of
from vmlend.topology.model import MANAGER_VM


def registry_violations(
    registry: Registry,
    lenders: LenderRegister | None = None,
    moving: Collection[str] = (),
) -> list[str]:
    """What is wrong now, one line each (empty: nothing):

    - a VM's mdev record sits on a node other than its device's holder's, or its device is not
      held by that VM (a share mdev: that VM on that node has no share of the drive);
    - a VM's NVMe share keeps the claims of another node (``incoming``, ``leaving``) while no
      hot migration of that VM is under way;
    - a hold carries claims made for the same VM on another node (a destination's room, or a
      source's not yet released) while no hot migration of that VM is under way (``moving``:
      the names of the VMs whose move is), or a hand-over record names a VM or source that
      does not hold; a shared drive's hold carries an interrupt window (``msi:``) that no
      share record of the drive keeps (its own claims, a move's incoming or leaving);
    - with ``lenders``: a held device whose lender serves a borrow other than its hold's
      (its token, its node and VM) once an mdev was made for it.
    """
    out: list[str] = []
    with registry.read() as tx:
        holds = tx.holds()
        claims = tx.claims()
        records = {r.fdid: r for r in tx.runtime(kind=KIND)}
        mdevs = tx.mdevs()
        shares = {(r.fdid, r.key): r.data for r in tx.runtime(kind=SHARE_RECORD)}
    for (fdid, key), data in shares.items():
        vm = data["holder"]["vm"]
        if ("incoming" in data or "leaving" in data) and vm not in moving:
            out.append(f"share {key} of {fdid:#x} keeps another node's claims, no move under way")
    for m in mdevs:
        if not m.vm:
            continue
        if m.type_id == SHARE_MDEV_TYPE:
            if (m.fdid, f"vm:{m.node}/{m.vm}") not in shares:
                out.append(f"share mdev {m.uuid} of {m.node}/{m.vm} on {m.fdid:#x}: no share")
            continue
        hold = holds.get(m.fdid)
        if hold is None or (hold.holder.node, hold.holder.vm) != (m.node, m.vm):
            out.append(f"mdev {m.uuid} of {m.node}/{m.vm} on {m.fdid:#x}, held by {hold}")
    # a shared drive's hold (its manager's) claims its shares' interrupt windows: each one a
    # share record of the drive keeps (its own, a move's incoming or leaving)
    share_windows: dict[int, set[str]] = {}
    for (fdid, _key), data in shares.items():
        kept = [
            *(data.get("claims") or ()),
            *((data.get("incoming") or {}).get("claims") or ()),
            *(data.get("leaving") or ()),
        ]
        share_windows.setdefault(fdid, set()).update(c["share"] for c in kept)
    for fdid, c in claims:
        hold = holds[fdid]
        mine = f"{hold.holder.node}/{hold.holder.vm}"
        owner = c.share.split(":", 1)[1] if c.share.startswith(("vm:", "msi:")) else None
        if hold.holder.vm == MANAGER_VM:
            if c.share.startswith("msi:") and c.share not in share_windows.get(fdid, set()):
                out.append(f"{fdid:#x} shared carries {c} of no share of it")
            continue
        if owner is not None and owner != mine and hold.holder.vm not in moving:
            out.append(f"{fdid:#x} held by {hold.holder} carries {c}, and no move is under way")
    for fdid, r in records.items():
        hold = holds.get(fdid)
        src = r.data.get("source")
        if fdid in {int(f) for f in r.data.get("shares", {})}:
            if (fdid, f"vm:{src}/{r.data.get('vm')}") not in shares:
                out.append(f"hand-over record {r.key} on {fdid:#x}: its VM has no share on {src}")
            continue
        if hold is None or hold.holder.node != src or hold.holder.vm_uuid != r.key:
            out.append(f"hand-over record {r.key} on {fdid:#x} does not match its hold {hold}")
    if lenders is not None:
        made = {m.fdid for m in mdevs if m.vm and m.type_id != SHARE_MDEV_TYPE}
        for fdid, hold in holds.items():
            if fdid not in made:
                continue
            serving = lenders.read(fdid)
            want = (hold.token, borrower_of(hold.holder.node, hold.holder.vm))
            if (serving.token, serving.borrower) != want:
                out.append(f"{fdid:#x}: lender serves {serving}, the hold is {want}")
    return out


def assert_consistent(
    registry: Registry,
    step: str,
    lenders: LenderRegister | None = None,
    moving: Collection[str] = (),
) -> None:
    found = registry_violations(registry, lenders, moving)
    assert found == [], f"after {step!r}:\n" + "\n".join(found)

