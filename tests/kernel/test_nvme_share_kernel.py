"""Queue-level NVMe shares on the production kernel backend (docs/smartio-contract.md section
7, "Per share"): the hook's prepare, run in-process as libvirt runs it, makes the VM's share
child under the stand-in's real mdev parent and writes the registry's share to it; the
stand-in's module records exactly those values (the child's files and the drive's
``nvme_shares``), fences an older epoch, and the release clears them. Then the module's own
checks of a write (errnos, permissions)."""

from __future__ import annotations

import errno
import io
import os
import stat
import uuid

import pytest
from click.testing import CliRunner

from tests.support.kernel_guest import LEND, REAL, STUB, parent_dir, write
from vmlend.cli import main
from vmlend.domain import (
    DeviceRequest,
    DomainSpec,
    NvmeShareRequest,
    TemplateSet,
    mdev_uuid,
    new_domain,
)
from vmlend.hook.main import run
from vmlend.kernel.mdev import MdevBus
from vmlend.ledger import nvmeshares as ledger
from vmlend.registry import SqliteRegistry
from vmlend.wiring.fabric import default_topology_text, init_fabric

VM_UUID = uuid.UUID("6f1c5a2e-0000-4000-8000-000000000712")
NVME = 0x12
PARENT = "smartio-12"
SHARE_TYPE = "smartio-nvme_share"
U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa7101"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa7102"


@pytest.fixture
def state(tmp_path, fabric_devices):
    path = tmp_path / "state.db"
    text, source = default_topology_text()
    init_fabric(path, text, source, node="gamma")
    return path


def hook(state, *argv, xml):
    err = io.StringIO()
    code = run(
        list(argv),
        stdin=io.BytesIO(xml),
        stdout=io.BytesIO(),
        stderr=err,
        environ={
            "VMLEND_STATE": str(state),
            "VMLEND_NODE": "gamma",
            "VMLEND_ROOT": os.environ["VMLEND_ROOT"],  # the test's, with the real sysfs
        },
    )
    return code, err.getvalue()


def share_xml() -> bytes:
    spec = DomainSpec(
        name="web",
        memory_bytes=512 * 1024 * 1024,
        uuid=VM_UUID,
        devices=[DeviceRequest(NVME, share=NvmeShareRequest(2, 64 * 1024 * 1024))],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def files(uuid_: str):
    group = REAL.mdev_devices / uuid_ / "smartio"
    return group / "nvme_share", group / "nvme_share_state"


def test_the_hooks_share_is_what_the_stand_in_runs_and_release_clears_it(state):
    STUB.share(NVME)
    r = CliRunner().invoke(
        main, ["--root", os.environ["VMLEND_ROOT"], "--state", str(state), "nvme", "share",
               "0x12", "--size", "1G"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    xml = share_xml()
    u = str(mdev_uuid(VM_UUID, NVME))
    assert hook(state, "web", "prepare", "begin", "-", xml=xml) == (0, "")

    dev = MdevBus(REAL).device(u)
    assert dev is not None and (dev.parent, dev.type_id) == (PARENT, SHARE_TYPE)
    with SqliteRegistry.open(state) as reg:
        (entry,) = ledger.shared_drives(reg)[NVME][2]
    s = entry.share
    assert (str(entry.holder), s.queue_pairs, s.blocks) == ("gamma/web", 2, 131072)
    # the values vmlend computed, as the contract spells them, and as the module keeps them
    lines = (
        f"queues {s.qid_base + 1} 2\nvectors {s.vector_base} 2\n"
        f"lba {s.lba_offset:#x} {s.blocks:#x}\nasid {s.asid}\n"
    )
    share_file, state_file = files(u)
    assert share_file.read_text() == "epoch 0\n" + lines
    assert state_file.read_text() == "active\nepoch 0\n" + lines + "msi 0 -\n"
    assert STUB.read(NVME, "nvme_shares") == (
        f"{u} 0 {s.qid_base + 1} 2 {s.vector_base} 2 {s.lba_offset:#x} {s.blocks:#x} {s.asid}\n"
    )
    assert hook(state, "web", "prepare", "begin", "-", xml=xml) == (0, "")  # libvirt retrying

    # the share moved hot and its destination took it over under epoch 1: the source's
    # prepare, still holding epoch 0, is refused by the module and changes nothing
    write(share_file, "epoch 1\n" + lines)
    code, err = hook(state, "web", "prepare", "begin", "-", xml=xml)
    assert code == 1 and "NVMe share of mdev" in err, err
    assert STUB.read(NVME, "nvme_shares").split()[:2] == [u, "1"]

    assert hook(state, "web", "release", "end", "-", xml=xml) == (0, "")
    assert STUB.read(NVME, "nvme_shares") == ""  # cleared: the manager runs nothing
    assert MdevBus(REAL).devices() == [] and STUB.registered() == []
    with SqliteRegistry.open(state) as reg:
        assert ledger.shared_drives(reg)[NVME][2] == []


def test_the_stand_ins_share_files_and_their_errnos(fabric_devices):
    """Only a shared drive's parent offers the share type; only its children have section
    7's files (mode 0644 and 0444); each bad write fails with the contract's errno and changes
    nothing; a removed child's share ends with it."""
    STUB.command("borrow", "0x10")
    assert [t.type_id for t in MdevBus(REAL).parent("smartio-10").types] == [
        "smartio-1", LEND,
    ]  # fmt: skip
    assert STUB.read(0x10, "nvme_share").startswith("unsupported ")
    STUB.share(NVME, queue_pairs=8, vectors=8)
    STUB.command("borrow", "0x12")
    assert STUB.read(NVME, "nvme_share") == "supported 8 8 0\n"
    bus = MdevBus(REAL)
    bus.create(PARENT, SHARE_TYPE, U1)
    bus.create(PARENT, SHARE_TYPE, U2)
    share_file, state_file = files(U1)
    assert stat.S_IMODE(share_file.stat().st_mode) == 0o644
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o444
    assert not (REAL.mdev_devices / U1 / "smartio" / "dma_windows").exists()
    assert (share_file.read_text(), state_file.read_text()) == ("", "none\n")
    mine = "epoch 2\nqueues 1 2\nvectors 1 2\nlba 0x0 0x100\nasid 1\n"
    write(share_file, mine)
    assert share_file.read_text() == mine

    def refused(path, text) -> int:
        with pytest.raises(OSError) as e:
            write(path, text)
        return e.value.errno

    other = files(U2)[0]
    assert refused(other, "queues 3 2\n") == errno.EINVAL  # no epoch first
    assert refused(other, "epoch 0\nvectors 3 2\nqueues 3 2\nlba 0 1\nasid 2\n") == errno.EINVAL
    assert refused(other, "epoch 0\nqueues 0 2\nvectors 3 2\nlba 0 1\nasid 2\n") == errno.EINVAL
    assert refused(other, "epoch 0\nqueues 8 2\nvectors 3 2\nlba 0x100 1\nasid 2\n") == (
        errno.ERANGE
    )  # queue ids past the controller's 8
    assert refused(other, "epoch 0\nqueues 2 2\nvectors 3 2\nlba 0x100 1\nasid 2\n") == (
        errno.EEXIST
    )  # queue id 2 is U1's
    assert refused(other, "epoch 0\nqueues 3 2\nvectors 3 2\nlba 0x100 1\nasid 1\n") == (
        errno.EEXIST
    )  # the tag is U1's
    assert refused(share_file, "epoch 2\nqueues 5 1\nvectors 5 1\nlba 0x0 0x100\nasid 1\n") == (
        errno.EBUSY
    )  # another allocation while set
    assert refused(share_file, "epoch 1\n") == errno.ESTALE  # a clear under an older epoch
    assert share_file.read_text() == mine and files(U2)[1].read_text() == "none\n"
    assert STUB.read(NVME, "nvme_shares") == f"{U1} 2 1 2 1 2 0x0 0x100 1\n"
    bus.remove(U1)  # the child goes without a clear: its share ends with it
    assert STUB.read(NVME, "nvme_shares") == ""
    assert parent_dir(NVME).is_dir()
