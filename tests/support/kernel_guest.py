"""Helpers for tests/kernel, which run in the kernel tier's guest against the real sysfs.

The guest has no SmartIO driver; it has the tier's stand-in for it (kernel-tier/, docs/testing.md):
the module ``smartio`` serves the driver's sysfs contract (docs/smartio-contract.md, sections 1
to 4) and ``smartio_mdev``, the kernel's mtty sample renamed, is the mdev parent the driver
registers on a device's own directory when vmlend borrows it. vmlend's kernel backend finds
both under their contract names, with no test adapter. What the rest of the fabric does (a
device joining it, a lender going away) is played through the stand-in's debugfs control."""

from __future__ import annotations

import os
from pathlib import Path

from vmlend.hostenv import HostEnv
from vmlend.kernel.driver import MDEV_TYPE, device_name
from vmlend.kernel.mdev import MdevBus
from vmlend.topology.model import Topology

#: The real host root inside the guest.
REAL = HostEnv(Path("/"))


def private_root(base: Path) -> HostEnv:
    """A host root of the test's own over the guest's real kernel: ``sys``, ``dev`` and
    ``proc`` are the guest's, everything vmlend keeps (``var/lib/vmlend``: the notes of the
    children it made, ``etc/vmlend``) is the test's, so the guest's own files stay untouched."""
    base.mkdir(parents=True, exist_ok=True)
    for tree in ("sys", "dev", "proc"):
        if not (base / tree).is_symlink():
            (base / tree).symlink_to(f"/{tree}")
    return HostEnv(base)
#: The node id init.sh loads the stand-in with: gamma's in the default topology.
NODE_ID = 12
#: vmlend's type (the contract's one type) and the parent's other one, kept to make children
#: vmlend did not create (as mdevctl or another share would); the types of every parent.
LEND = MDEV_TYPE
FOREIGN = "smartio-1"
#: Each parent's pool of serial ports: a smartio-lend child takes two, a smartio-1 child one.
PORTS = 3
#: The stand-in's control file (debugfs, outside the contract).
CTL = Path("/sys/kernel/debug/smartio/ctl")
#: The modules (init.sh loads them; tests unload and load them again).
MODULES = Path("/lib/modules/vmlend")


def write(path: Path, text: str) -> None:
    """One write(2), as a sysfs store handler wants it; the errno comes back as OSError."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def parent_dir(fdid: int) -> Path:
    """The device's own directory: the stand-in's device, and its mdev parent once borrowed."""
    return Path("/sys/devices/virtual/smartio") / device_name(fdid)


def available(fdid: int, type_id: str = LEND) -> int:
    return MdevBus(REAL).parent(device_name(fdid)).type(type_id).available_instances


class SmartioStub:
    """The stand-in for the SmartIO driver (kernel-tier/smartio_stub.c): the contract's own
    files through ``REAL.smartio``, the rest of the fabric through ``CTL``."""

    base = REAL.smartio

    def ctl(self, line: str) -> None:
        write(CTL, line)

    def add(
        self,
        fdid: int,
        lender_node_id: int,
        *,
        adapter: int = 0,
        bdf: str = "0000:41:00.0",
        vendor: int = 0x8086,
        device: int = 0x0A54,
        class_code: int = 0x010802,
        dma_bits: int = 64,
        physfn: int | None = None,
        availability: str = "available",
        bars: str = "0:0x4000:mem64",
    ) -> None:
        pf = "-" if physfn is None else f"{physfn:#x}"
        self.ctl(
            f"add {fdid:#x} {lender_node_id} {adapter} {bdf} {vendor:#x} {device:#x}"
            f" {class_code:#x} {dma_bits} {pf} {availability} {bars or '-'}"
        )

    def add_adapter(
        self,
        index: int,
        *,
        model: str = "PXH830",
        window_size: int = 128 << 30,
        segments: int = 32,
        lut_entries: int = 32,
        link: str = "up",
        peer: tuple[int, int] | None = None,
        switch_port: int | None = None,
    ) -> None:
        """One of this host's NTB adapters (the contract's section 1), until ``reset``."""
        to = "-" if peer is None else f"{peer[0]}:{peer[1]}"
        port = "-" if switch_port is None else str(switch_port)
        self.ctl(
            f"adapter {index} {model} {window_size:#x} {segments} {lut_entries} {link} {to} {port}"
        )

    def populate(self, topology: Topology) -> None:
        """Every device of ``topology`` as the driver lists it (lent ones available)."""
        ids = {n.name: n.node_id for n in topology.nodes}
        for d in topology.devices:
            bars = ",".join(
                f"{b.index}:{b.size:#x}:{b.kind.value}{':prefetch' if b.prefetch else ''}"
                for b in d.bars
            )
            self.add(
                d.fdid,
                ids[d.lender],
                bdf=d.bdf,
                vendor=d.vendor_id,
                device=d.device_id,
                class_code=d.class_code,
                dma_bits=d.dma_bits,
                physfn=d.physfn,
                availability="available" if d.lent else "unlent",
                bars=bars,
            )

    def set_availability(self, fdid: int, value: str) -> None:
        """The lender lends, withdraws, goes away or comes back."""
        self.ctl(f"availability {fdid:#x} {value}")

    def set_borrower(self, fdid: int, node_id: int) -> None:
        """The hardware borrow (-1: none), as when a guest enables the device."""
        self.ctl(f"borrower {fdid:#x} {node_id}")

    def share(self, fdid: int, queue_pairs: int = 511, vectors: int = 32) -> None:
        """The driver can run the manager for ``fdid`` (contract section 7): its
        ``nvme_share`` says so and its parent, registered after this, offers
        ``smartio-nvme_share``."""
        self.ctl(f"share {fdid:#x} {queue_pairs} {vectors}")

    def remove(self, fdid: int) -> None:
        self.ctl(f"remove {fdid:#x}")

    def reset(self) -> None:
        """Every device leaves the fabric (their parents, and children, with them), and every
        adapter this host has."""
        self.ctl("reset")

    def command(self, name: str, text: str) -> None:
        """Write ``text`` to ``class/smartio/<name>`` (lend, borrow, take_back...)."""
        write(self.base / name, text)

    def read(self, fdid: int, attr: str) -> str:
        return (self.base / device_name(fdid) / attr).read_text()

    def registered(self) -> list[str]:
        """The SmartIO parents registered now (``class/mdev_bus/smartio-*``)."""
        return [n for n in MdevBus(REAL).parent_names() if n.startswith("smartio-")]


STUB = SmartioStub()


def remove_all_mdevs() -> None:
    """Remove every mdev child the kernel has (through the real sysfs)."""
    bus = MdevBus(REAL)
    for dev in bus.devices():
        bus.remove(dev.uuid)
    assert bus.devices() == []


def clean_fabric() -> None:
    """No child, no parent, no device: what every test starts and ends with."""
    remove_all_mdevs()
    STUB.reset()
    assert not STUB.registered() and not [p for p in STUB.base.iterdir() if p.is_symlink()]
