"""The kernel backend writes each child's DMA windows (docs/smartio-contract.md section 8)
where the prepare path knows the guest's layout, and reads back what the driver says."""

# ruff: noqa: F811 (the imported fixtures are parameters of the tests)

from __future__ import annotations

import logging

import pytest

from tests.support.smartio_host import (  # noqa: F401
    NVME,
    U1,
    U2,
    WEB,
    fabric,
    fake,
    state,
)
from vmlend.errors import FabricError, LayoutError, StaleTokenError
from vmlend.kernel.dmafiles import DmaWord, format_windows
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.memory.layout import MemoryConfig, compute_layout
from vmlend.topology.model import GiB, GuestRam, Holder

RAM = GuestRam(tuple(compute_layout(MemoryConfig("q35", 8 * GiB)).ranges()))
WRITTEN = "low 0x0 0x80000000\nhigh 0x100000000 0x180000000\n"


def _acquire(fabric, journal=None, ram=RAM, uuid=U1, holder=WEB):
    journal = UndoJournal() if journal is None else journal
    return acquire_device(fabric, holder, NVME, uuid, journal, guest_ram=ram)


def _windows_file(fake, uuid=U1):
    return fake.env.mdev_devices / uuid / "smartio" / "dma_windows"


def test_the_prepare_path_writes_the_holds_token_and_the_guests_windows(fabric, fake):
    lines: list[str] = []
    acquire_device(fabric, WEB, NVME, U1, UndoJournal(), guest_ram=RAM, record=lines.append)
    token = fabric._state.holds()[NVME].token
    assert token > 0
    assert fake.smartio.window_writes[U1] == [f"token {token}\n" + WRITTEN]
    assert _windows_file(fake).read_text() == f"token {token}\n" + WRITTEN
    assert any("DMA windows of 0x12 (low, high)" in ln for ln in lines)
    report = fabric.dma_report(U1)
    assert report is not None and report.written is not None
    assert report.written.token == token
    assert [w.name for w in report.written.windows] == ["low", "high"]
    assert report.state is not None and report.state.word is DmaWord.NONE


def test_a_rerun_writes_the_same_windows_again_and_changes_nothing(fabric, fake):
    _acquire(fabric)
    before = _windows_file(fake).read_text()
    _acquire(fabric)
    writes = fake.smartio.window_writes[U1]
    assert len(writes) == 2 and writes[0] == writes[1]
    assert _windows_file(fake).read_text() == before


def test_the_segment_size_is_the_lender_adapters(fabric, fake):
    """Segments larger than the gap between low and high RAM: one ``low+high`` window,
    as the planner's ``window_groups`` makes it, so the driver maps what admission counted."""
    topo = fabric.topology()
    lender = topo.device(NVME).lender
    adapter = topo.adapter(f"{lender}:0")
    assert adapter is not None and adapter.segment_size == 4 * GiB
    small = GuestRam(tuple(compute_layout(MemoryConfig("q35", 3 * GiB)).ranges()))
    assert fabric.expected_windows(NVME, small)[0].name == "low"
    assert [w.name for w in fabric.expected_windows(NVME, RAM)] == ["low", "high"]


def test_a_driver_without_the_group_warns_once_and_the_vm_starts(fabric, fake, caplog):
    fake.smartio.data_path = False
    with caplog.at_level(logging.WARNING):
        _acquire(fabric)
    assert fabric.bus.device(U1) is not None  # the child stays: the VM starts
    warnings = [r for r in caplog.records if "maps no DMA window" in r.getMessage()]
    assert len(warnings) == 1 and "update the driver" in warnings[0].getMessage()
    assert fabric.dma_report(U1) is None


def test_only_a_byte_count_writes_nothing(fabric, fake):
    """The agent re-taking a hold knows the RAM's size, not its ranges: no guess is written."""
    lines: list[str] = []
    acquire_device(fabric, WEB, NVME, U1, UndoJournal(), guest_ram=8 * GiB, record=lines.append)
    assert fake.smartio.window_writes[U1] == []
    assert any("layout is not known" in ln for ln in lines)


def test_a_refused_write_undoes_the_child_as_a_refused_create(fabric, fake):
    fake.smartio.devs[NVME].attrs["dma_bits"] = "32"  # RAM up to 10 GiB is past its reach
    journal = UndoJournal()
    with pytest.raises(FabricError, match="ERANGE"):
        _acquire(fabric, journal)
    assert journal.rollback() == []
    assert fabric.bus.device(U1) is None and fabric.mdev_records() == []
    assert fabric._state.holds() == {}


def test_an_older_token_is_estale(fabric, fake):
    _acquire(fabric)
    token = fabric._state.holds()[NVME].token
    with pytest.raises(StaleTokenError, match=f"fencing token {token - 1}"):
        fabric.driver.write_dma_windows(NVME, U1, token - 1, f"token {token - 1}\n" + WRITTEN)
    assert _windows_file(fake).read_text() == f"token {token}\n" + WRITTEN


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("low 0x0 0x80000000 0x1000 0x1000\n", "EINVAL"),  # out of order
        ("low 0x1 0x1000\n", "EINVAL"),  # unaligned
        ("low 0x0 0x1000 0x1000 0x1000\n", "EINVAL"),  # touching
        ("high 0x0 0x1000\n", "EINVAL"),  # a high range below 4 GiB
        ("low+high 0x0 0x1000\nhigh 0x100000000 0x1000\n", "EINVAL"),
        ("".join(f"low {i * 0x2000:#x} 0x1000\n" for i in range(2)), "EINVAL"),  # twice
    ],
)
def test_the_fake_driver_refuses_malformed_windows(fabric, fake, body, error):
    _acquire(fabric)
    token = fabric._state.holds()[NVME].token
    with pytest.raises(FabricError, match=error):
        fabric.driver.write_dma_windows(NVME, U1, token, f"token {token}\n" + body)


def test_too_many_ranges_is_e2big(fabric, fake):
    _acquire(fabric)
    token = fabric._state.holds()[NVME].token
    many = " ".join(f"{i * 0x2000:#x} 0x1000" for i in range(65))
    with pytest.raises(LayoutError, match="more than 64"):
        fabric.driver.write_dma_windows(NVME, U1, token, f"token {token}\nlow {many}\n")


def test_other_windows_while_mapped_are_ebusy(fabric, fake):
    _acquire(fabric)
    fake.smartio.bus_master(U1)
    token = fabric._state.holds()[NVME].token
    with pytest.raises(FabricError, match="EBUSY"):
        fabric.driver.write_dma_windows(NVME, U1, token, f"token {token}\nlow 0x0 0x1000\n")
    _acquire(fabric)  # the same windows again: accepted
    report = fabric.dma_report(U1)
    assert report is not None and report.state is not None
    assert report.state.word is DmaWord.MAPPED


def test_the_token_line_alone_clears_the_windows(fabric, fake):
    _acquire(fabric)
    token = fabric._state.holds()[NVME].token
    fabric.driver.write_dma_windows(NVME, U1, token, format_windows(token, ()))
    report = fabric.dma_report(U1)
    assert report is not None and report.written is not None and report.written.windows == ()


def test_a_damaged_state_file_is_reported_not_raised(fabric, fake):
    _acquire(fabric)
    fake.smartio.set_dma_state(U1, "mapping\n")
    report = fabric.dma_report(U1)
    assert report is not None and "unknown state" in report.damaged


def test_each_vm_writes_its_own_childs_windows(fabric, fake):
    _acquire(fabric)
    fabric.remove_mdev(U1)
    fabric.release(NVME, WEB)
    db = Holder("gamma", "db", "22222222-2222-2222-2222-222222222222")
    small = GuestRam(tuple(compute_layout(MemoryConfig("q35", 1 * GiB)).ranges()))
    _acquire(fabric, ram=small, uuid=U2, holder=db)
    token = fabric._state.holds()[NVME].token
    assert _windows_file(fake, U2).read_text() == f"token {token}\nlow 0x0 0x40000000\n"
