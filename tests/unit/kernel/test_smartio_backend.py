"""What only the kernel backend does: touch sysfs, believe the driver about availability, undo
kernel steps that fail, and follow a lender's reboot through uevents."""

# ruff: noqa: F811 (the imported fixtures are parameters of the tests)

from __future__ import annotations

import os
import re
import sqlite3

import pytest

from tests.support.fake_sysfs import (
    FakeSysfs,
    PipeUeventSource,
    RacingWriter,
)

# the host's fixtures, which the tests below name as parameters
from tests.support.smartio_host import (  # noqa: F401
    NVME,
    PARENT,
    U1,
    U2,
    WEB,
    fabric,
    fake,
    other_view,
    start_vm,
    state,
)
from vmlend.errors import (
    DeviceNotLentError,
    FabricError,
    HostError,
    LenderUnavailableError,
    MdevBadNameError,
    MdevBusyError,
    MdevParentGoneError,
    StaleTokenError,
)
from vmlend.kernel.backend import SmartioFabric, open_smartio_fabric, overlay
from vmlend.kernel.driver import MDEV_TYPE, Availability, SmartioDevice
from vmlend.kernel.udev import Outcome
from vmlend.lending.devices import return_all
from vmlend.registry import SqliteRegistry
from vmlend.topology.model import DeviceState, DeviceStatus, Holder


def test_start_and_stop_drive_the_kernel(fabric, fake):
    start_vm(fabric)
    assert fabric.bus.parent(PARENT).type(MDEV_TYPE).devices == (U1,)
    assert fabric.bus.device(U1).parent == PARENT
    assert fabric.remove_mdev(U1) is True
    assert fabric.bus.device(U1) is None
    assert fabric.release(NVME, WEB) is True
    # Released: the parent goes too, so the driver stops holding it for us.
    assert PARENT not in fabric.bus.parent_names()
    assert fabric.driver.device(NVME).parent_registered is False


def test_unreachable_lender_makes_device_unavailable(fabric, fake):
    fake.smartio.set_availability(NVME, "unreachable")
    assert fabric.device(NVME).state is DeviceState.UNAVAILABLE
    with pytest.raises(LenderUnavailableError):
        fabric.reserve(NVME, WEB)
    with pytest.raises(LenderUnavailableError):
        fabric.ensure_mdev_parent(NVME)
    checks = fabric.admission(NVME, "gamma")
    assert not checks[0].ok and "alpha" in checks[0].detail


def test_driver_withdrawal_wins_over_the_registry(fabric, fake):
    fake.smartio.set_availability(NVME, "unlent")
    assert fabric.device(NVME).state is DeviceState.UNLENT
    with pytest.raises(DeviceNotLentError):
        fabric.reserve(NVME, WEB)


def test_guest_enable_shows_as_borrowed(fabric, fake):
    start_vm(fabric)
    assert fabric.device(NVME).state is DeviceState.RESERVED
    fake.smartio.guest_enable(NVME)
    assert fabric.device(NVME).state is DeviceState.BORROWED
    assert {d.fdid: d.state for d in fabric.devices()}[NVME] is DeviceState.BORROWED


def test_failed_kernel_create_leaves_no_record_and_no_note(fabric, fake):
    fabric.reserve(NVME, WEB)
    fabric.ensure_mdev_parent(NVME)
    fabric.bus.writer = RacingWriter(
        fake, lambda: fake.smartio.set_availability(NVME, "unreachable")
    )
    with pytest.raises(MdevParentGoneError):
        fabric.create_mdev(NVME, U1, WEB)
    assert fabric.mdevs() == [] and fabric.wanted_mdevs() == []
    assert fabric.made.all() == []  # nor a note of the child on the host


def test_busy_child_keeps_its_record(fabric, fake):
    start_vm(fabric)
    fake.busy.add(U1)
    with pytest.raises(MdevBusyError):
        fabric.remove_mdev(U1)
    assert [w.uuid for w in fabric.wanted_mdevs()] == [U1]


def test_other_drivers_children_are_not_ours(fabric, fake):
    fake.add_mtty()
    fabric.bus.create("mtty", "mtty-1", "83b8f4f2-509f-382f-3c1e-e6bfe0fa1009")
    start_vm(fabric)
    assert [m.uuid for m in fabric.mdevs()] == [U1]


def test_lending_is_for_the_lender(fabric):
    with pytest.raises(FabricError, match="installed in alpha"):
        fabric.unlend(NVME)


def test_driver_not_loaded(state, tmp_path):
    empty = FakeSysfs(tmp_path / "empty")
    with SmartioFabric(SqliteRegistry.open(state), empty.env, writer=empty) as fab:
        with pytest.raises(HostError, match="modprobe smartio"):
            fab.devices()
        with pytest.raises(HostError):
            fab.reserve(NVME, WEB)


def test_lender_reboot_recreates_the_running_vms_mdev(fabric, fake, other_view):
    start_vm(fabric)
    watcher = fabric.watcher()
    assert watcher.discover() == [PARENT]
    assert [r.outcome for r in watcher.reactions] == [Outcome.PRESENT]
    watcher.reactions.clear()
    source = PipeUeventSource()
    fake.listeners.append(source.send)
    try:
        fake.smartio.set_availability(NVME, "unreachable")
        watcher.run(source, timeout=0.1)
        assert fabric.bus.device(U1) is None
        # Every process sharing the state now sees the device as unavailable.
        assert other_view.device(NVME).state is DeviceState.UNAVAILABLE

        fake.smartio.set_availability(NVME, "available")  # the driver re-registers the parent
        stop_r, stop_w = os.pipe()
        os.write(stop_w, b"x")
        watcher.run(source, stop_fd=stop_r, timeout=5)
        os.close(stop_r)
        os.close(stop_w)
    finally:
        source.close()
    # The driver's availability event and MDEV_STATE both announce each change; the vanishing
    # is handled once, the explicit "registered" is re-checked and finds the child present.
    assert [r.outcome for r in watcher.reactions] == [
        Outcome.UNAVAILABLE,
        Outcome.RECREATED,
        Outcome.PRESENT,
    ]
    assert fabric.bus.device(U1).parent == PARENT
    assert other_view.device(NVME).state is DeviceState.RESERVED


def test_open_smartio_fabric(state, fake):
    with open_smartio_fabric(state, "gamma", fake.env, fake) as fab:
        assert fab.local_node == "gamma"
        assert fab.device(NVME).state is DeviceState.AVAILABLE


def _dev(availability: Availability, borrower: int | None = None) -> SmartioDevice:
    return SmartioDevice(
        NVME, 4, 0, "0000:43:00.0", 0x8086, 0x0A54, 0x010802, 64, (), availability, borrower,
        None, False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("registry", "dev", "want"),
    [
        (DeviceState.AVAILABLE, _dev(Availability.AVAILABLE), DeviceState.AVAILABLE),
        (DeviceState.AVAILABLE, None, DeviceState.UNAVAILABLE),
        (DeviceState.RESERVED, _dev(Availability.UNREACHABLE), DeviceState.UNAVAILABLE),
        (DeviceState.AVAILABLE, _dev(Availability.UNLENT), DeviceState.UNLENT),
        (DeviceState.UNLENT, _dev(Availability.AVAILABLE), DeviceState.UNLENT),
        (DeviceState.RESERVED, _dev(Availability.AVAILABLE, 12), DeviceState.BORROWED),
        (DeviceState.RESERVED, _dev(Availability.AVAILABLE, 8), DeviceState.RESERVED),
    ],
)
def test_overlay(fabric, registry, dev, want):
    spec = fabric.topology().device(NVME)
    holder = WEB if registry is DeviceState.RESERVED else None
    assert overlay(DeviceStatus(spec, registry, holder), dev, 12).state is want


# --- the driver forgets the parent once the device's last use on this node ends -------------


def recorded_parent(state) -> bool:
    with SqliteRegistry.open(state) as reg, reg.read() as tx:
        return tx.parent("gamma", NVME) is not None


def test_release_while_the_lender_is_unreachable_ends_the_drivers_remembering(fabric, fake, state):
    start_vm(fabric)
    fake.smartio.set_availability(NVME, "unreachable")  # the driver drops parent and child
    assert PARENT not in fabric.bus.parent_names()
    assert return_all(fabric, WEB, [(NVME, U1)]) == []
    fake.smartio.set_availability(NVME, "available")  # the lender is back
    # Nobody runs on this node with it any more: the driver must not bring the parent back.
    assert PARENT not in fabric.bus.parent_names()
    assert fabric.device(NVME).holder is None and not recorded_parent(state)


def test_a_release_rerun_unborrows_the_parent(fabric, fake, state):
    start_vm(fabric)
    fake.busy.add(U1)  # QEMU still has the child open: the first release cannot remove it
    failures = return_all(fabric, WEB, [(NVME, U1)])
    assert any(U1 in f for f in failures)
    assert fabric.device(NVME).holder == WEB  # kept while its mdev lives
    assert PARENT in fabric.bus.parent_names()  # its child is still there
    fake.busy.discard(U1)
    assert return_all(fabric, WEB, [(NVME, U1)]) == []  # libvirt's release hook, re-run
    assert fabric.bus.device(U1) is None
    assert PARENT not in fabric.bus.parent_names()
    assert fabric.driver.device(NVME).parent_registered is False
    assert not recorded_parent(state)


def test_the_parent_stays_while_another_vm_here_holds_the_device(fabric, fake):
    start_vm(fabric)
    fabric.remove_mdev(U1)
    fabric.release(NVME, WEB)
    other = Holder("gamma", "db", "22222222-2222-2222-2222-222222222222")
    fabric.reserve(NVME, other)
    fabric.ensure_mdev_parent(NVME)
    assert fabric.release(NVME, WEB) is False  # not web's any more
    assert PARENT in fabric.bus.parent_names()


def test_a_refused_borrow_records_no_parent(fabric, fake, state):
    fabric.reserve(NVME, WEB)
    # The lender goes away between the availability check and the driver's 'borrow'.
    fabric.driver.writer = RacingWriter(
        fake, lambda: fake.smartio.set_availability(NVME, "unreachable")
    )
    with pytest.raises(LenderUnavailableError):
        fabric.ensure_mdev_parent(NVME)
    assert not recorded_parent(state)
    assert PARENT not in fabric.bus.parent_names()


def test_an_interrupt_window_only_where_the_driver_maps_msi_over_the_ntb(state, fake):
    """A driver without ``msi/capable`` (or saying 0) carries interrupts on the relay: asking
    for the NTB claims nothing there. One that says 1 gets the window (contract section 6)."""
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        fabric.reserve(NVME, WEB, msi_over_ntb=True)
        assert fabric.interrupt_window(NVME) is None
        fabric.release(NVME, WEB)
        msi = fake.env.smartio / "smartio-12" / "msi"
        msi.mkdir()
        (msi / "capable").write_text("0\n")
        fabric.reserve(NVME, WEB, msi_over_ntb=True)
        assert fabric.interrupt_window(NVME) is None
        fabric.release(NVME, WEB)
        (msi / "capable").write_text("1\n")
        fabric.reserve(NVME, WEB, msi_over_ntb=True)
        window = fabric.interrupt_window(NVME)
        assert window is not None and window.adapter == "alpha:0"


def test_a_hostile_type_id_in_the_registry_never_steers_a_sysfs_write(fabric, fake, state):
    """A damaged (or hostile) mdev record names type ``../../x``: the backend would write the
    UUID into ``x/create`` beside the parent's directory. It is refused before any path is
    built from it, and the planted file is untouched."""
    fabric.reserve(NVME, WEB)
    fabric.ensure_mdev_parent(NVME)
    planted = fake.root / "sys" / "devices" / "virtual" / "x"
    planted.mkdir()
    (planted / "create").write_text("untouched")
    with sqlite3.connect(state) as db:
        db.execute(
            "INSERT INTO mdevs VALUES (?, ?, 'gamma', ?, '../../x', 'web', 0)", (U1, NVME, PARENT)
        )
    with pytest.raises(MdevBadNameError, match=re.escape("refusing mdev type name '../../x'")):
        fabric.create_mdev(NVME, U1, WEB)
    assert (planted / "create").read_text() == "untouched"
    assert fabric.bus.device(U1) is None


def test_the_mdev_carries_the_holds_fencing_token_and_the_driver_refuses_an_older_one(
    fabric, fake, other_view
):
    """docs/smartio-contract.md, "The fencing token": vmlend writes the hold's token before it
    creates the child; a holder whose hold ended (its host cut off) and that comes back late
    with its old token is refused by the driver, and its mdev record does not stay."""
    start_vm(fabric)
    first = other_view.holds()[NVME].token
    assert fake.smartio.devs[NVME].tokens == [first] and first > 0
    fabric.remove_mdev(U1)
    fabric.release(NVME, WEB)
    other = Holder("gamma", "db", "22222222-2222-2222-2222-222222222222")
    fabric.reserve(NVME, other)
    fabric.ensure_mdev_parent(NVME)
    fabric.create_mdev(NVME, U2, other)
    newer = other_view.holds()[NVME].token
    assert newer > first and fake.smartio.devs[NVME].token == newer
    # the old holder's late step, as its host still believes in its hold
    with pytest.raises(StaleTokenError, match="fencing token"):
        fabric.driver.set_token(NVME, first)
    assert fake.smartio.devs[NVME].token == newer


def test_a_release_spends_the_token_so_an_mdev_in_flight_for_that_hold_is_refused(
    fabric, fake, state
):
    """The nemesis's seed 4, on the kernel backend: this process checked the hold and recorded
    the child; another process released the hold before this one wrote the token. The driver,
    not the parent's bookkeeping, refuses the late step: the release spent the token."""
    fabric.reserve(NVME, WEB)
    fabric.ensure_mdev_parent(NVME)
    token = fabric._state.holds()[NVME].token
    read_holds = fabric._state.holds

    def holds_then_release():
        holds = read_holds()
        with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as other:
            assert other.release(NVME, WEB)
        return holds

    fabric._state.holds = holds_then_release  # type: ignore[method-assign]
    with pytest.raises(StaleTokenError):
        fabric.create_mdev(NVME, U1, WEB)
    assert fake.smartio.devs[NVME].spent == token
    assert fabric.bus.device(U1) is None and fabric.mdevs() == []


def test_a_release_that_spent_the_token_but_did_not_land_gives_the_vm_a_new_hold(
    fabric, fake
):
    """The driver spent the token; the registry then failed and the hold stayed. The VM's
    next reserve ends that dead hold and takes a new token, and its mdev is made."""
    from vmlend.errors import RegistryUnreachableError

    start_vm(fabric)
    first = fabric._state.holds()[NVME].token
    fabric.remove_mdev(U1)
    transact = fabric._state.registry.transact

    def unreachable(body):
        raise RegistryUnreachableError("127.0.0.1:1", "etcd at 127.0.0.1:1 does not answer")

    fabric._state.registry.transact = unreachable  # type: ignore[method-assign]
    with pytest.raises(RegistryUnreachableError):
        fabric.release(NVME, WEB)
    fabric._state.registry.transact = transact  # type: ignore[method-assign]
    assert fake.smartio.devs[NVME].spent == first
    assert fabric.reserve(NVME, WEB).created
    assert fabric._state.holds()[NVME].token > first
    fabric.ensure_mdev_parent(NVME)
    fabric.create_mdev(NVME, U1, WEB)
    assert fabric.bus.device(U1) is not None


def test_a_driver_without_spent_still_releases_with_a_warning(fabric, fake, caplog):
    """A SmartIO driver older than the contract's 'spent': the release goes on (it is not
    refused for want of an attribute), and says what protection is missing."""
    start_vm(fabric)
    fabric.remove_mdev(U1)
    (fake.smartio._dir(NVME) / "spent").unlink()
    assert fabric.release(NVME, WEB)
    assert fabric._state.holds() == {}
    assert "has no" in caplog.text and "update the driver" in caplog.text


def lose_the_lease(state) -> None:
    """What etcd does when gamma's lease ends: every record on it goes (the hold, the mdev's
    and the parent's), while the kernel keeps the child and the parent."""

    def body(tx) -> None:
        tx.delete_hold(NVME)
        tx.delete_mdev(U1)
        tx.delete_parent("gamma", NVME)

    with SqliteRegistry.open(state) as reg:
        reg.transact(body)


def test_a_release_after_the_lease_went_removes_the_child_this_host_made(fabric, fake, state):
    start_vm(fabric)
    lose_the_lease(state)
    assert fabric.wanted_mdevs() == []  # the agent re-creates nothing from a note
    # The VM stops: its release finds no record in the registry, but this host noted the child
    # it made, so the child and then the parent go, and the note with them.
    lines: list[str] = []
    assert return_all(fabric, WEB, [(NVME, U1)], lines.append) == []
    assert f"mdev {U1}: removed" in lines
    assert fabric.bus.device(U1) is None
    assert PARENT not in fabric.bus.parent_names()
    assert fabric.driver.device(NVME).parent_registered is False
    assert fabric.made.all() == []


def test_a_note_never_takes_another_vms_child(fabric, fake, state):
    start_vm(fabric)
    # The registry records U1 as web's; a note claiming it for db changes nothing.
    db = Holder("gamma", "db", "22222222-2222-2222-2222-222222222222")
    (note,) = fabric.made.all()
    fabric.made.note(type(note)(note.uuid, note.fdid, note.parent, note.type_id, "gamma", "db"))
    return_all(fabric, db, [(NVME, U1)])
    assert fabric.bus.device(U1) is not None and fabric.device(NVME).holder == WEB


def test_a_note_in_a_directory_others_may_write_is_not_believed(fabric, fake, state, caplog):
    start_vm(fabric)
    lose_the_lease(state)
    os.chmod(fabric.made.dir, 0o777)
    lines: list[str] = []
    assert return_all(fabric, WEB, [(NVME, U1)], lines.append) == []
    assert fabric.bus.device(U1) is not None  # left, and said how to remove it
    assert any("vmlend mdev remove" in line for line in lines)
    assert "ignoring the notes of made mdevs" in caplog.text
