"""The NVMe controller model driven by an unmodified driver's flow in a VM that borrowed the
drive exclusively: every queue entry, PRP list and data byte crosses the NTB by DMA."""

from __future__ import annotations

import pytest

from tests.support.nvme_guest import VmBar0, guest_driver
from tests.support.simcluster import Cluster, domain_xml
from vmlend.errors import DmaFault
from vmlend.nvme import spec
from vmlend.sim.nvme.driver import NvmeCommandError
from vmlend.sim.nvmedrive import attach_nvme
from vmlend.topology.model import GiB, MiB

NVME = 0x12


@pytest.fixture
def simc(state_path):
    c = Cluster.create(state_path)
    yield c
    c.close()


@pytest.fixture
def drive(simc, tmp_path):
    d = attach_nvme(simc.hw, NVME, tmp_path, blocks=1 << 20)
    yield d
    d.close()


@pytest.fixture
def vm(simc, drive):
    vm = simc.start(domain_xml("db", 256 * MiB))
    vm.enable_device(NVME)
    yield vm
    vm.stop()


def test_bring_up_identify_and_queues(vm, drive):
    drv = guest_driver(VmBar0(vm, NVME), vm.guest)
    cap = drv.mmio.read(spec.REG_CAP, 8)
    assert spec.cap_mqes(cap) == 1023 and spec.cap_dstrd(cap) == 0
    assert drv.mmio.read(spec.REG_VS, 4) == spec.VERSION_1_4
    queues = drv.start(queues=4)
    assert [q.qid for q in queues] == [1, 2, 3, 4]
    ident = drv.identify_controller()
    assert ident["serial"] == "VMLEND00000012" and ident["namespaces"] == 1
    assert drv.identify_namespace(1) == (1 << 20, 512)
    assert drv.active_namespaces() == [1]
    assert drive.controller.queue_ids() == [1, 2, 3, 4]
    # CAP is read-only: a write leaves it as it was
    drv.mmio.write(spec.REG_CAP, 4, 0)
    assert drv.mmio.read(spec.REG_CAP, 8) == cap


def test_write_read_back_with_prp_lists_lands_in_the_sparse_file(vm, drive):
    drv = guest_driver(VmBar0(vm, NVME), vm.guest)
    (qp,) = drv.start(queues=1)
    for blocks in (1, 8, 9, 64, 256):  # one page, two pages (PRP2), PRP list, 128 KiB
        data = bytes((blocks + i) % 251 for i in range(blocks * 512))
        assert drv.write(qp, 1000, data).ok
        done, back = drv.read(qp, 1000, blocks)
        assert done.ok and back == data
    assert drv.flush(qp).ok
    assert drive.namespace.read(1000, 1) == bytes((256 + i) % 251 for i in range(512))
    assert drive.namespace.allocated_bytes() < 1 * MiB  # 512 MiB namespace, sparse


def test_phase_tag_wraps_and_msix_vector_per_queue(vm, drive):
    drv = guest_driver(VmBar0(vm, NVME), vm.guest)
    fired: list[int] = []
    drive.device.on_interrupt(fired.append)
    q1, q2 = drv.start(queues=2, entries=4)
    for i in range(10):  # 4-entry queues wrap twice: the phase tag flips each time
        assert drv.write(q1, i, bytes([i]) * 512).ok
    assert (q1.cq_head, q1.phase) == (2, 1)  # wrapped twice: phase flipped back to 1
    assert drv.read(q2, 9, 1)[1] == bytes([9]) * 512
    assert fired.count(1) == 10 and fired.count(2) == 1


def test_batched_submissions_complete_in_order(vm, drive):
    drv = guest_driver(VmBar0(vm, NVME), vm.guest)
    (qp,) = drv.start(queues=1, entries=16)
    reqs = [drv.submit_io(qp, spec.IO_WRITE, 8 * i, 1, bytes([i]) * 512) for i in range(10)]
    drv.ring(qp)
    done = drv.reap(qp)
    assert [c.cid for c in done] == [r.cid for r in reqs] and all(c.ok for c in done)


def test_bad_commands_get_their_status(vm, drive):
    drv = guest_driver(VmBar0(vm, NVME), vm.guest)
    (qp,) = drv.start(queues=1)
    beyond = spec.io_command(spec.IO_READ, 77, 1, (1 << 20) - 1, 2, prp1=32 * MiB)
    assert drv.submit_raw(qp, beyond).status == spec.SC_LBA_OUT_OF_RANGE
    wrong_ns = spec.io_command(spec.IO_READ, 78, 2, 0, 1, prp1=32 * MiB)
    assert drv.submit_raw(qp, wrong_ns).status == spec.SC_INVALID_NAMESPACE
    assert drv.submit_raw(qp, spec.Command(0x7F, 79, 1)).status == spec.SC_INVALID_OPCODE
    unaligned = spec.io_command(spec.IO_READ, 80, 1, 0, 1, prp1=32 * MiB + 2)
    assert drv.submit_raw(qp, unaligned).status == spec.SC_PRP_OFFSET_INVALID
    with pytest.raises(NvmeCommandError) as e:
        drv.create_queue_pair(1)  # exists
    assert e.value.status == spec.SC_INVALID_QID
    with pytest.raises(NvmeCommandError) as e:
        drv.create_queue_pair(5000)
    assert e.value.status == spec.SC_INVALID_QID


def test_data_outside_the_guest_faults_at_the_iommu(vm, drive):
    drv = guest_driver(VmBar0(vm, NVME), vm.guest)
    (qp,) = drv.start(queues=1)
    outside = spec.io_command(spec.IO_READ, 90, 1, 0, 1, prp1=8 * GiB)  # no RAM there
    assert drv.submit_raw(qp, outside).status == spec.SC_DATA_TRANSFER_ERROR
    fault = drive.controller.stats.faults[-1]
    assert isinstance(fault, DmaFault) and fault.hop == "lender-iommu"


def test_reset_deletes_queues_and_flr_restores_registers(vm, drive):
    drv = guest_driver(VmBar0(vm, NVME), vm.guest)
    drv.start(queues=2)
    drv.reset()
    assert drive.controller.queue_ids() == [] and not drive.controller.ready
    drv.start(queues=1)
    assert drive.controller.queue_ids() == [1]
    drive.device.reset()
    assert drive.device.bars.read(0, spec.REG_CAP, 8) == drive.controller.cap
    assert drive.controller.queue_ids() == []
