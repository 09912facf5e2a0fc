"""Traffic through a running demo VM, each checked where it lands: a device's DMA into guest
RAM (read back by the guest), a peer write into another device's BAR, a DMA into the PCI hole
(which must fault), interrupts raised on the lender counted on the VM's eventfds, and a link
fault on a device's path that the device survives over the borrower's other adapter."""

from __future__ import annotations

from vmlend.demo import facts
from vmlend.demo.context import Json, Story, require
from vmlend.errors import DemoError, DmaFault
from vmlend.topology.model import GiB, format_fdid

PAYLOAD = b"vmlend: block 0 of the remote NVMe drive, DMA'd straight into guest memory. "


def dma_into_guest(s: Story, fdid: int, gpa: int, length: int = 8192) -> Json:
    """``fdid`` DMA-writes a buffer at ``gpa``; the guest reads its page back."""
    vm = s.vm()
    data = (PAYLOAD * (length // len(PAYLOAD) + 1))[:length]
    targets = vm.dma_write(fdid, gpa, data)
    back = vm.guest.read(gpa, length)
    first = targets[0]
    require(back == data, f"device {fdid:#x} wrote {length} bytes but the guest read others")
    require(
        first.kind == "ram" and first.owner == s.config.vm,
        f"device {fdid:#x}'s DMA landed in {first.kind} of {first.owner}, not the guest's RAM",
    )
    require(
        first.address == vm.guest.host_address(gpa),
        "the DMA landed on another host page than the one backing the guest address",
    )
    return {
        "device": format_fdid(fdid),
        "gpa": gpa,
        "bytes": length,
        "match": back == data,
        "pages": len(targets),
        "host_page": first.address,
        "target": facts.target_json(first),
    }


def p2p_write(s: Story, src: int, dst: int, bar: int, offset: int, data: bytes) -> Json:
    """``src`` DMA-writes at ``dst``'s guest BAR address; it must land in that BAR."""
    vm = s.vm()
    base = vm.session(dst).guest_bar(bar)
    if base is None:
        raise DemoError(f"the guest has not placed BAR {bar} of {dst:#x}")
    (t,) = vm.dma_write(src, base + offset, data)
    landed = s.c.hw.device(dst).bars.read_bytes(bar, offset, len(data))
    ok = (t.kind, t.owner, t.bar, t.offset) == ("bar", dst, bar, offset) and landed == data
    require(ok, f"the DMA from {src:#x} at {dst:#x} BAR {bar} landed in {t.describe()}")
    return {
        "source": format_fdid(src),
        "target": format_fdid(dst),
        "bar": bar,
        "gpa": base + offset,
        "bytes": len(data),
        "landed": ok,
        "target_hops": facts.target_json(t),
    }


def hole_fault(s: Story, fdid: int) -> Json:
    """A DMA into the PCI hole (between low RAM and 4 GiB, away from every guest BAR) faults."""
    vm = s.vm()
    bars = [(b.address, b.address + b.size) for f in vm.devices() for b in vm.bars(f)]
    gpa = vm.layout.below_4g
    while any(lo <= gpa < hi for lo, hi in bars):
        gpa = next(hi for lo, hi in bars if lo <= gpa < hi)
    require(gpa < 4 * GiB, "no address in the PCI hole is free of guest BARs")
    try:
        vm.dma_write(fdid, gpa, b"\xff" * 64)
    except DmaFault as e:
        return {
            "device": format_fdid(fdid),
            "gpa": gpa,
            "faulted": True,
            "hop": e.hop,
            "why": e.why,
        }
    raise DemoError(f"a DMA by {fdid:#x} into the PCI hole at {gpa:#x} did not fault")


def interrupts(s: Story, fdids: list[int]) -> list[Json]:
    g = s.c.guest(s.node).guest(s.config.vm)
    out = []
    for fdid in fdids:
        got = g.irqs.fire(s.c.hw.device(fdid), s.config.interrupts)
        wired = g.irqs.devices[fdid]
        out.append(
            wired.json() | {"raised": s.config.interrupts, "received": sum(got), "per_vector": got}
        )
        require(
            sum(got) == s.config.interrupts,
            f"device {fdid:#x} raised {s.config.interrupts} interrupts, the VM got {sum(got)}",
        )
    return out


def link_failover(s: Story, fdid: int, gpa: int) -> Json:
    """The cable of ``fdid``'s route at the VM's node goes down: the fabric re-routes the
    device over the node's other adapter (when it has one), its DMA still lands in the guest,
    and the cable comes back. ``{"link": None}`` without another route to show."""
    hw = s.c.hw
    borrow = hw.borrowed(fdid)
    if borrow is None or borrow.path is None:
        return {"link": None}
    link = borrow.path.links[-1]  # the cable into the VM's node
    others = [p for p in hw.routes(borrow.lender, borrow.node) if link not in p.links]
    if not others:
        return {"link": None}
    fabric = s.c.fabric()
    down = fabric.set_link_up(link, False)
    mine = [f for f in down.faults if f.fdid == fdid]
    require(
        bool(mine) and mine[0].state == "rerouted",
        f"device {fdid:#x} was not re-routed when {link} went down",
    )
    dma = dma_into_guest(s, fdid, gpa)
    up = fabric.set_link_up(link, True)
    return {
        "link": link,
        "device": format_fdid(fdid),
        "was": mine[0].was,
        "now": mine[0].path,
        "dma": dma,
        "after_up": [f.state for f in up.faults if f.fdid == fdid],
    }
