"""IOMMU domains: page size choice, entry counts, overlap refusal, translation faults."""

from __future__ import annotations

import pytest

from vmlend.errors import DmaFault, IommuMappingError
from vmlend.sim.iommu import IommuDomain, NodeIommu, Requester
from vmlend.topology.model import GiB, KiB, MiB

K4, M2, G1 = 4 * KiB, 2 * MiB, 1 * GiB


@pytest.fixture
def dom() -> IommuDomain:
    return IommuDomain("gamma:vm:web")


def test_aligned_gigabytes_use_1g_pages(dom):
    dom.map(4 * GiB, 8 * GiB, 3 * GiB)
    assert dom.entries() == {K4: 0, M2: 0, G1: 3}


def test_misaligned_start_climbs_then_descends_page_sizes(dom):
    # iova and phys agree modulo 1 GiB, start 4 KiB past a 2 MiB boundary, end 8 KiB short.
    iova, phys = 1 * GiB - 2 * MiB + 4 * KiB, 5 * GiB - 2 * MiB + 4 * KiB
    size = (2 * MiB - 4 * KiB) + 1 * GiB + 2 * MiB + 4 * KiB
    dom.map(iova, phys, size)
    assert dom.entries() == {K4: 511 + 1, M2: 1, G1: 1}
    for probe in (iova, 1 * GiB, 2 * GiB, iova + size - 1):
        assert dom.translate(probe) == phys + (probe - iova)


def test_no_large_pages_when_iova_and_phys_disagree(dom):
    dom.map(0, 2 * MiB + 4 * KiB, 4 * MiB)
    assert dom.entries() == {K4: 1024, M2: 0, G1: 0}


def test_explicit_page_size_is_honoured_and_checked(dom):
    dom.map(0, 0, 1 * GiB, page_size=M2)
    assert dom.entries()[M2] == 512
    with pytest.raises(IommuMappingError, match="aligned"):
        dom.map(2 * GiB + 4 * KiB, 0, 2 * MiB, page_size=M2)
    with pytest.raises(IommuMappingError, match="not 4 KiB"):
        dom.map(4 * GiB, 0, 8 * KiB, page_size=8 * KiB)


def test_overlap_is_refused_and_changes_nothing(dom):
    dom.map(0x10_0000, 0x20_0000, 0x10_0000)
    before = dom.mappings()
    with pytest.raises(IommuMappingError, match="overlaps"):
        dom.map(0x1F_F000, 0x90_0000, 0x2000)
    with pytest.raises(IommuMappingError):
        dom.map(0, 0, 0x40_0000)  # covers it entirely
    assert dom.mappings() == before
    dom.map(0x20_0000, 0x30_0000, 0x1000)  # adjacent is fine


def test_bad_arguments(dom):
    with pytest.raises(IommuMappingError):
        dom.map(0x1000, 0x1001, 0x1000)
    with pytest.raises(IommuMappingError):
        dom.map(0x1000, 0x1000, 0)
    with pytest.raises(IommuMappingError):
        dom.map(-0x1000, 0x1000, 0x1000)


def test_translate_unmapped_faults_with_the_domain_name(dom):
    dom.map(0, 0x10_0000, 0x1000)
    assert dom.translate(0xFFF) == 0x10_0FFF
    with pytest.raises(DmaFault) as e:
        dom.translate(0x1000)
    assert e.value.hop == "gamma:vm:web" and e.value.address == 0x1000


def test_read_only_mapping_refuses_writes(dom):
    dom.map(0, 0x10_0000, 0x1000, writable=False)
    assert dom.translate(0x10) == 0x10_0010
    with pytest.raises(DmaFault, match="read-only"):
        dom.translate(0x10, write=True)


def test_unmap_middle_of_4k_run(dom):
    dom.map(0, 0x100_0000, 16 * K4, page_size=K4)
    assert dom.unmap(4 * K4, 2 * K4) == 2 * K4
    assert dom.entries()[K4] == 14
    assert dom.lookup(4 * K4) is None
    assert dom.translate(6 * K4) == 0x100_0000 + 6 * K4
    assert dom.translate(3 * K4) == 0x100_0000 + 3 * K4


def test_unmap_cannot_split_a_large_page(dom):
    dom.map(0, 0, 1 * GiB)
    with pytest.raises(IommuMappingError, match="split"):
        dom.unmap(4 * KiB, 4 * KiB)
    assert dom.entries()[G1] == 1
    assert dom.unmap(0, 2 * GiB) == 1 * GiB  # holes are fine
    assert dom.mapped_bytes == 0


def test_remap_after_unmap(dom):
    dom.map(0, 0, 2 * MiB)
    dom.unmap(0, 2 * MiB)
    dom.map(0, 4 * MiB, 2 * MiB)
    assert dom.translate(0) == 4 * MiB


def test_node_iommu_context():
    ctx = NodeIommu("alpha")
    a, b = IommuDomain("a"), IommuDomain("b")
    dev = Requester(0x4100)
    ingress = Requester(0xF002)  # entered through the adapter on bus f0, its LUT entry 2
    ctx.attach(dev, a)
    ctx.attach(dev, a)  # idempotent
    ctx.attach(ingress, b)
    assert ctx.domain_for(dev) is a and ctx.domain_for(ingress) is b
    assert ctx.domain_for(Requester(0xF003)) is None
    with pytest.raises(IommuMappingError, match="already attached"):
        ctx.attach(dev, b)
    assert ctx.detach(dev) and not ctx.detach(dev)
    assert str(ingress) == "f0:00.2"


def test_unmap_across_several_runs_keeps_the_outside(dom):
    dom.map(0, 0x10_0000, 4 * K4)
    dom.map(4 * K4, 0x90_0000, 4 * K4)
    dom.map(8 * K4, 0x50_0000, 4 * K4)
    assert dom.unmap(2 * K4, 8 * K4) == 8 * K4
    assert [(m.iova, m.phys, m.size) for m in dom.mappings()] == [
        (0, 0x10_0000, 2 * K4),
        (10 * K4, 0x50_0000 + 2 * K4, 2 * K4),
    ]
    assert dom.entries()[K4] == 4
    assert dom.unmap(100 * K4, K4) == 0
