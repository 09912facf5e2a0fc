"""The tier's SmartIO stand-in (kernel-tier/smartio_stub.c and the renamed mtty) against
docs/smartio-contract.md: what vmlend's kernel backend reads, the errnos of its writes, the
files' permissions, and the mdev parent a borrow registers on the device's own directory."""

from __future__ import annotations

import errno
import stat

import pytest

from tests.support.kernel_guest import (
    FOREIGN,
    LEND,
    NODE_ID,
    PORTS,
    REAL,
    STUB,
    available,
    parent_dir,
    write,
)
from vmlend.errors import DeviceNotLentError, LenderUnavailableError, StaleTokenError
from vmlend.kernel.driver import Availability, SmartioDriver
from vmlend.kernel.mdev import MdevBus

PARENT = "smartio-12"
U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa7001"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa7002"
#: A device installed in this host (gamma), for lend and unlend.
LOCAL = 0x40
#: A device's attributes in section 2 of the contract (all read-only).
READ_ONLY = (
    "fdid", "lender_node_id", "lender_adapter", "lender_bdf", "vendor", "device", "class",
    "dma_bits", "physfn", "bars", "availability", "borrower_node_id",
)  # fmt: skip


def refused(path, text) -> int:
    with pytest.raises(OSError) as e:
        write(path, text)
    return e.value.errno


def test_the_kernel_backend_reads_the_fabric_the_stand_in_serves(fabric_devices):
    driver = SmartioDriver(REAL)
    assert driver.loaded() and driver.node_id() == NODE_ID
    found, damaged = driver.scan()
    assert damaged == []
    nodes = {n.name: n.node_id for n in fabric_devices.nodes}
    assert [d.fdid for d in found] == sorted(d.fdid for d in fabric_devices.devices)
    by_fdid = {d.fdid: d for d in found}
    for spec in fabric_devices.devices:
        d = by_fdid[spec.fdid]
        assert (d.lender_node_id, d.lender_adapter, d.lender_bdf) == (
            nodes[spec.lender], 0, spec.bdf,
        )  # fmt: skip
        assert (d.vendor_id, d.device_id, d.class_code, d.dma_bits) == (
            spec.vendor_id, spec.device_id, spec.class_code, spec.dma_bits,
        )  # fmt: skip
        assert d.bars == spec.bars and d.physfn == spec.physfn
        assert d.availability is Availability.AVAILABLE and d.borrower_node_id is None
        assert not d.parent_registered
    # As the contract prints them: hex fdids, an empty line for "no PF", one BAR a line.
    assert STUB.read(0x12, "fdid") == "0x12\n" and STUB.read(0x12, "physfn") == "\n"
    assert STUB.read(0x22, "physfn") == "0x21\n" and STUB.read(0x12, "token") == "0\n"
    assert STUB.read(0x10, "bars") == (
        "0 0x1000000 mem32\n1 0x800000000 mem64 prefetch\n3 0x2000000 mem64 prefetch\n"
    )


def test_the_files_have_the_contracts_permissions(fabric_devices):
    def mode(path):
        return stat.S_IMODE(path.stat().st_mode)

    assert mode(STUB.base / "node_id") == 0o444
    for command in ("lend", "unlend", "borrow", "unborrow", "take_back"):
        assert mode(STUB.base / command) == 0o200, command
    d = STUB.base / PARENT
    for attr in READ_ONLY:
        assert mode(d / attr) == 0o444, attr
    assert mode(d / "token") == 0o644 and mode(d / "spent") == 0o644
    # Even root cannot write a read-only attribute, nor read a command.
    assert refused(STUB.base / "node_id", "4") == errno.EACCES
    assert refused(d / "availability", "unlent") == errno.EACCES
    with pytest.raises(PermissionError):
        (STUB.base / "borrow").read_text()


def test_lend_borrow_token_and_take_back_refuse_as_the_contract_says(fabric_devices):
    base = STUB.base
    for command in ("lend", "unlend", "borrow", "unborrow"):
        assert refused(base / command, "twelve") == errno.EINVAL, command
        assert refused(base / command, "0x99") == errno.ENODEV, command
    assert refused(base / "lend", "0x12") == errno.EREMOTE  # installed in alpha
    assert refused(base / "unlend", "0x12") == errno.EREMOTE

    # A device of this host: lend and unlend, refused while borrowed in hardware.
    STUB.add(LOCAL, NODE_ID, availability="unlent")
    write(base / "lend", f"{LOCAL:#x}")
    assert STUB.read(LOCAL, "availability") == "available\n"
    write(base / "lend", f"{LOCAL:#x}")  # idempotent
    STUB.set_borrower(LOCAL, 8)
    assert refused(base / "unlend", f"{LOCAL:#x}") == errno.EBUSY
    assert STUB.read(LOCAL, "borrower_node_id") == "8\n"

    # Fencing tokens: the largest is kept, an older one is ESTALE, garbage EINVAL.
    token = base / f"smartio-{LOCAL:x}" / "token"
    write(token, "5")
    write(token, "5")
    assert refused(token, "4") == errno.ESTALE and refused(token, "x") == errno.EINVAL
    assert token.read_text() == "5\n"
    take_back = base / "take_back"
    assert refused(take_back, f"{LOCAL:#x}") == errno.EINVAL
    assert refused(take_back, f"{LOCAL:#x} five") == errno.EINVAL
    assert refused(take_back, "0x99 5") == errno.ENODEV
    assert refused(take_back, f"{LOCAL:#x} 4") == errno.ESTALE
    assert STUB.read(LOCAL, "borrower_node_id") == "8\n"  # a stale take-back touched nothing
    write(take_back, f"{LOCAL:#x} 5")
    assert STUB.read(LOCAL, "borrower_node_id") == "-1\n"
    # The taken-back token is spent: its ended hold cannot step again before a newer one comes.
    assert refused(token, "5") == errno.ESTALE
    write(token, "6")
    # A hold's release spends its token, served yet or not (a step made for it in flight
    # elsewhere is refused); spending an older one changes nothing, garbage is EINVAL.
    spent = base / f"smartio-{LOCAL:x}" / "spent"
    assert spent.read_text() == "5\n"
    write(spent, "7")
    write(spent, "3")
    assert spent.read_text() == "7\n" and refused(spent, "x") == errno.EINVAL
    assert refused(token, "7") == errno.ESTALE and token.read_text() == "6\n"
    write(token, "8")
    write(base / "unlend", f"{LOCAL:#x}")
    assert STUB.read(LOCAL, "availability") == "unlent\n"

    # vmlend's driver turns the kernel's errnos into its errors.
    driver = SmartioDriver(REAL)
    with pytest.raises(StaleTokenError):
        driver.set_token(LOCAL, 4)
    driver.spend(LOCAL, 9)
    with pytest.raises(StaleTokenError):
        driver.set_token(LOCAL, 9)
    STUB.set_availability(0x12, "unlent")
    with pytest.raises(DeviceNotLentError):
        driver.register_parent(0x12)
    STUB.set_availability(0x12, "unreachable")
    with pytest.raises(LenderUnavailableError):
        driver.register_parent(0x12)
    assert STUB.registered() == []


def test_borrow_registers_the_parent_on_the_devices_own_directory(fabric_devices):
    bus = MdevBus(REAL)
    STUB.command("borrow", "0x12")
    STUB.command("borrow", "0x12")  # idempotent
    assert STUB.registered() == [PARENT]
    own = parent_dir(0x12)
    assert (REAL.mdev_bus / PARENT).resolve() == own == (STUB.base / PARENT).resolve()
    parent = bus.parent(PARENT)
    assert [t.type_id for t in parent.types] == [FOREIGN, LEND]
    lend = parent.type(LEND)
    assert (lend.name, lend.device_api, lend.available_instances) == (
        "SmartIO lent device", "vfio-pci", 1,
    )  # fmt: skip
    assert PARENT in lend.description
    assert available(0x12, FOREIGN) == PORTS
    assert SmartioDriver(REAL).device(0x12).parent_registered

    # One smartio-lend child per parent; a child of the other type beside it.
    bus.create(PARENT, LEND, U1)
    assert available(0x12) == 0 and available(0x12, FOREIGN) == PORTS - 2
    bus.create(PARENT, FOREIGN, U2)
    assert (own / U1).is_dir() and (own / U2).is_dir()
    assert refused(STUB.base / "unborrow", "0x12") == errno.EBUSY  # children first
    bus.remove(U1)
    bus.remove(U2)
    STUB.command("unborrow", "0x12")
    assert STUB.registered() == [] and not (own / "mdev_supported_types").exists()
    STUB.command("unborrow", "0x12")  # no parent: success


def test_an_unreachable_lender_takes_the_parent_away_and_brings_it_back(fabric_devices):
    bus = MdevBus(REAL)
    STUB.command("borrow", "0x12")
    bus.create(PARENT, LEND, U1)
    STUB.set_availability(0x12, "unreachable")
    assert STUB.registered() == [] and bus.devices() == []  # the child went with the parent
    assert refused(STUB.base / "borrow", "0x12") == errno.EHOSTUNREACH
    # The driver remembers the borrow: the parent returns with the lender, without its child.
    STUB.set_availability(0x12, "available")
    assert STUB.registered() == [PARENT] and bus.devices() == []
    # unborrow ends the remembering.
    STUB.command("unborrow", "0x12")
    STUB.set_availability(0x12, "unreachable")
    STUB.set_availability(0x12, "available")
    assert STUB.registered() == []
