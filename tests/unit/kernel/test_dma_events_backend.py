"""The kernel backend's watcher and the data path (docs/smartio-contract.md section 8): a child
re-created after its lender returns gets its DMA windows from the RAM this host noted, and the
driver's ``SMARTIO_DMA`` events become the device's ``dma-window`` runtime records. Events
travel from the fake kernel through a real pipe into the watcher's select loop."""

# ruff: noqa: F811 (the imported fixtures are parameters of the tests)

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import msgspec
import pytest

from tests.support.fake_sysfs import PipeUeventSource
from tests.support.smartio_host import (  # noqa: F401
    NVME,
    PARENT,
    U1,
    U2,
    WEB,
    fabric,
    fake,
    state,
)
from vmlend.kernel.backend import SmartioFabric
from vmlend.kernel.made_mdevs import MadeMdevs, notes_dir
from vmlend.kernel.udev import Outcome, ParentWatcher, Uevent
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.memory.dmarecords import DMA_REFUSAL, DMA_WINDOW
from vmlend.memory.layout import MemoryConfig, compute_layout
from vmlend.registry import RuntimeRecord
from vmlend.topology.model import GiB, GuestRam

RAM = GuestRam(tuple(compute_layout(MemoryConfig("q35", 8 * GiB)).ranges()))
WINDOWS = "low 0x0 0x80000000\nhigh 0x100000000 0x180000000\n"


@pytest.fixture
def source(fake) -> Iterator[PipeUeventSource]:
    s = PipeUeventSource()
    yield s
    s.close()


def started(
    fabric: SmartioFabric, fake, source: PipeUeventSource, ram: GuestRam | int = RAM
) -> ParentWatcher:
    """web started with ``ram`` (the prepare path), and a watcher that has looked once and
    hears the kernel's events from then on."""
    acquire_device(fabric, WEB, NVME, U1, UndoJournal(), guest_ram=ram)
    watcher = fabric.watcher()
    watcher.discover()
    watcher.reactions.clear()
    fake.listeners.append(source.send)
    return watcher


def lender_reboots(fabric, fake, watcher, source) -> None:
    fake.smartio.set_availability(NVME, "unreachable")
    watcher.run(source, timeout=0.05)
    assert fabric.bus.device(U1) is None
    fake.smartio.set_availability(NVME, "available")
    watcher.run(source, timeout=0.05)


def records(fabric, kind=DMA_WINDOW) -> list[RuntimeRecord]:
    with fabric.registry.read() as tx:
        return tx.runtime(NVME, kind)


# --- the watcher re-creating a child -------------------------------------------------------------
def test_the_note_keeps_the_guests_ram_from_the_windows_write(fabric):
    acquire_device(fabric, WEB, NVME, U1, UndoJournal(), guest_ram=RAM)
    made = MadeMdevs(notes_dir(fabric.env)).get(U1)
    assert made is not None and made.vm == "web" and made.ram == RAM


def test_a_recreated_child_gets_its_windows_with_the_holds_token(fabric, fake, source):
    watcher = started(fabric, fake, source)
    token = fabric._state.holds()[NVME].token
    lender_reboots(fabric, fake, watcher, source)
    assert [r.outcome for r in watcher.reactions][:2] == [Outcome.UNAVAILABLE, Outcome.RECREATED]
    assert fabric.bus.device(U1) is not None
    # the child is new: its one write is the watcher's, with the hold's token of now
    assert fake.smartio.window_writes[U1] == [f"token {token}\n" + WINDOWS]
    report = fabric.dma_report(U1)
    assert report is not None and report.written is not None and report.written.token == token


def test_a_note_without_ram_recreates_the_child_and_warns_once(fabric, fake, source, caplog):
    # the agent's way: the size alone, no layout
    watcher = started(fabric, fake, source, ram=8 * GiB)
    assert MadeMdevs(notes_dir(fabric.env)).get(U1).ram is None
    with caplog.at_level(logging.WARNING):
        lender_reboots(fabric, fake, watcher, source)
    assert Outcome.RECREATED in [r.outcome for r in watcher.reactions]
    assert fake.smartio.window_writes[U1] == []
    said = [r.getMessage() for r in caplog.records if "without DMA windows" in r.getMessage()]
    assert len(said) == 1 and "'vmlend reconcile --fix' writes them" in said[0]


def test_a_note_from_before_the_ram_field_still_reads(fabric, fake, source, caplog):
    watcher = started(fabric, fake, source)
    note = notes_dir(fabric.env) / f"{U1}.json"
    old = json.loads(note.read_bytes())
    del old["ram"]
    note.write_text(json.dumps(old))
    made = MadeMdevs(notes_dir(fabric.env)).get(U1)
    assert made is not None and made.ram is None and made.vm == "web"
    assert [m.uuid for m in fabric.mdev_records()] == [U1]
    with caplog.at_level(logging.WARNING):
        lender_reboots(fabric, fake, watcher, source)
    assert fake.smartio.window_writes[U1] == []
    assert "no RAM layout" in caplog.text


def test_a_note_naming_another_vm_is_not_used(fabric, fake, source, caplog):
    """The registry's record wins: another VM's RAM would map the wrong guest."""
    watcher = started(fabric, fake, source)
    notes = MadeMdevs(notes_dir(fabric.env))
    made = notes.get(U1)
    small = GuestRam(tuple(compute_layout(MemoryConfig("q35", 1 * GiB)).ranges()))
    notes.note(msgspec.structs.replace(made, vm="db", ram=small))
    with caplog.at_level(logging.WARNING):
        lender_reboots(fabric, fake, watcher, source)
    assert fabric.bus.device(U1) is not None
    assert fake.smartio.window_writes[U1] == []
    assert "names VM 'db'" in caplog.text and "reconcile --fix" in caplog.text


def test_a_refused_write_removes_the_recreated_child(fabric, fake, source):
    watcher = started(fabric, fake, source)
    fake.smartio.devs[NVME].attrs["dma_bits"] = "32"  # 10 GiB of RAM is now past its reach
    lender_reboots(fabric, fake, watcher, source)
    failed = [r for r in watcher.reactions if r.outcome is Outcome.FAILED]
    assert failed and "ERANGE" in failed[0].detail and failed[0].uuid == U1
    assert fabric.bus.device(U1) is None
    # the record stays: the VM still runs, so reconcile reports the child missing
    assert [m.uuid for m in fabric.mdev_records()] == [U1]


# --- SMARTIO_DMA ---------------------------------------------------------------------------------
def test_bus_master_records_the_mapped_windows_and_clearing_it_removes_them(
    fabric, fake, source
):
    watcher = started(fabric, fake, source)
    fake.smartio.bus_master(U1)
    watcher.run(source, timeout=0.05)
    assert [(r.outcome, r.uuid, r.vm, r.parent) for r in watcher.reactions] == [
        (Outcome.DMA_RECORDED, U1, "web", PARENT)
    ]
    got = {r.key: r.data for r in records(fabric)}
    assert list(got) == ["high", "low"]
    lender = fabric.topology().device(NVME).lender
    assert got["low"] == {
        "gpa_start": 0,
        "gpa_end": 0x8000_0000,
        "ranges": [[0, 0x8000_0000]],
        "adapter": f"{lender}:0",
        "segments": [0],
        "segment_size": 4 * GiB,
        "state": "mapped",
    }
    assert got["high"]["ranges"] == [[4 * GiB, 10 * GiB]] and got["high"]["segments"] == [1, 2]

    fake.smartio.bus_master(U1, on=False)
    watcher.run(source, timeout=0.05)
    assert records(fabric) == []
    assert watcher.reactions[-1].detail == "none"


def test_a_refusal_is_kept_apart_from_the_windows(fabric, fake, source):
    watcher = started(fabric, fake, source)
    token = fabric._state.holds()[NVME].token
    fabric.driver.write_dma_windows(NVME, U1, token, f"token {token}\n")  # none written
    fake.smartio.bus_master(U1)
    watcher.run(source, timeout=0.05)
    assert records(fabric) == []
    refusal = records(fabric, DMA_REFUSAL)
    assert [(r.key, r.data["error"], r.data["mdev"]) for r in refusal] == [
        ("bus-master", "ENODATA", U1)
    ]
    # the next enable maps: the refusal goes
    fabric.write_dma_windows(NVME, U1, RAM, holder=WEB)
    fake.smartio.bus_master(U1, on=False)
    fake.smartio.bus_master(U1)
    watcher.run(source, timeout=0.05)
    assert records(fabric, DMA_REFUSAL) == [] and len(records(fabric)) == 2


def test_the_file_decides_not_the_events_word(fabric, fake, source):
    """An event only says when to read: a stale word records what dma_state says now."""
    watcher = started(fabric, fake, source)
    fake.smartio.bus_master(U1)
    fake.smartio.set_dma_state(U1, "none\n")  # unmapped again before vmlend read
    watcher.run(source, timeout=0.05)
    assert records(fabric) == []


def test_an_event_for_an_unknown_uuid_is_ignored(fabric, fake, source, caplog):
    watcher = started(fabric, fake, source)
    with caplog.at_level(logging.INFO):
        fake.emit(Uevent("change", U2, "mdev", {"SMARTIO_DMA": "mapped"}))  # no such child
        watcher.run(source, timeout=0.05)
    assert watcher.reactions == [] and records(fabric) == []
    assert f"mdev {U2} has no smartio/ group" in caplog.text


def test_an_event_for_a_child_vmlend_did_not_record_is_ignored(fabric, fake, source, caplog):
    watcher = started(fabric, fake, source)
    fabric.registry.transact(lambda tx: tx.delete_mdev(U1))  # its record went (a lost lease)
    with caplog.at_level(logging.INFO):
        fake.smartio.bus_master(U1)
        watcher.run(source, timeout=0.05)
    assert watcher.reactions == [] and records(fabric) == []
    assert "vmlend made no such child on this host" in caplog.text


def test_an_event_after_the_vms_hold_ended_writes_nothing(fabric, fake, source, caplog):
    watcher = started(fabric, fake, source)
    fabric.release(NVME, WEB)  # the child stays in the kernel: its record too
    fake.smartio.bus_master(U1)
    with caplog.at_level(logging.INFO):
        watcher.run(source, timeout=0.05)
    assert watcher.reactions == [] and records(fabric) == []
    assert "its VM 'web' does not hold device 0x12 now" in caplog.text


@pytest.mark.parametrize("value", ["mapping", "", "MAPPED", "refused ENODATA"])
def test_a_garbage_word_is_a_warning_and_records_nothing(fabric, fake, source, caplog, value):
    watcher = started(fabric, fake, source)
    fake.smartio.set_dma_state(U1, "mapped\nlow - - 0x0 0x80000000\n")
    with caplog.at_level(logging.WARNING):
        fake.emit(Uevent("change", U1, "mdev", {"SMARTIO_DMA": value}))
        watcher.run(source, timeout=0.05)
    assert watcher.reactions == [] and records(fabric) == []
    assert "ignoring a SmartIO driver event" in caplog.text and "update the driver" in caplog.text


def test_a_child_whose_vm_lost_its_device_is_not_recreated_under_the_new_holders_token(
    fabric, fake, source
):
    """web's hold ended while the lender was away (its lease, say) and db holds the device
    now; web's record of its child is still there. Re-created with db's token, the child's
    windows (web's RAM) would pass the driver's fencing check for db's borrow: the watcher
    removes it again instead, and writes nothing."""
    from vmlend.topology.model import Holder

    watcher = started(fabric, fake, source)
    fabric.registry.transact(lambda tx: tx.delete_hold(NVME))
    db = Holder("gamma", "db")
    fabric.reserve(NVME, db, guest_ram=RAM)
    lender_reboots(fabric, fake, watcher, source)
    failed = [r for r in watcher.reactions if r.outcome is Outcome.FAILED]
    assert failed and failed[0].uuid == U1 and "held by gamma/db" in failed[0].detail
    assert fabric.bus.device(U1) is None
    assert fake.smartio.window_writes.get(U1, []) == []  # the re-created child got none


def test_acquiring_a_child_again_keeps_the_noted_ram(fabric):
    acquire_device(fabric, WEB, NVME, U1, UndoJournal(), guest_ram=RAM)
    acquire_device(fabric, WEB, NVME, U1, UndoJournal(), guest_ram=8 * GiB)  # size only
    made = MadeMdevs(notes_dir(fabric.env)).get(U1)
    assert made is not None and made.ram == RAM
