"""The pure parts of the NVMe model: entry formats, doorbell arithmetic, PRP walking, guard."""

from __future__ import annotations

import struct

import msgspec
import pytest

from vmlend.nvme import spec
from vmlend.nvme.guard import ADDRESS_BITS, GuardRejection, QueueDomain, asid_base
from vmlend.nvme.prp import PrpError, build_prp_list, list_pages_needed, prp_pieces

PAGE = spec.PAGE


def test_submission_entry_layout_matches_the_spec():
    cmd = spec.io_command(spec.IO_WRITE, 0x1234, 1, 0x1_0000_0002, 8, prp1=0x1000, prp2=0x2000)
    raw = cmd.encode()
    assert len(raw) == 64
    assert raw[0] == spec.IO_WRITE and int.from_bytes(raw[2:4], "little") == 0x1234
    assert int.from_bytes(raw[24:32], "little") == 0x1000
    assert int.from_bytes(raw[40:44], "little") == 2  # SLBA low in CDW10
    assert int.from_bytes(raw[44:48], "little") == 1  # SLBA high in CDW11
    assert int.from_bytes(raw[48:52], "little") == 7  # NLB is zero-based
    back = spec.Command.decode(raw)
    assert back == cmd and back.slba == 0x1_0000_0002 and back.blocks == 8


def test_completion_entry_phase_and_status_bits():
    c = spec.Completion(cid=9, status=spec.SC_LBA_OUT_OF_RANGE, sq_id=3, sq_head=5, phase=1)
    raw = c.encode()
    dw3 = int.from_bytes(raw[12:16], "little")
    assert dw3 & 0xFFFF == 9 and dw3 >> 16 & 1 == 1 and dw3 >> 17 == 0x80
    assert int.from_bytes(raw[8:12], "little") == 3 << 16 | 5
    assert spec.Completion.decode(raw) == c


def test_bad_entry_sizes_are_refused():
    with pytest.raises(ValueError):
        spec.Command.decode(b"\0" * 63)
    with pytest.raises(ValueError):
        spec.Completion.decode(b"\0" * 15)
    with pytest.raises(ValueError):
        spec.io_command(spec.IO_READ, 0, 1, 0, 0)


@pytest.mark.parametrize("dstrd", [0, 1, 9])
def test_doorbells_follow_the_stride(dstrd):
    stride = 4 << dstrd
    assert spec.doorbell_offset(0, False, dstrd) == 0x1000
    assert spec.doorbell_offset(3, True, dstrd) == 0x1000 + 7 * stride
    for qid in (0, 1, 511):
        for cq in (False, True):
            assert spec.doorbell_of(spec.doorbell_offset(qid, cq, dstrd), dstrd) == (qid, cq)
    assert spec.doorbell_of(0x0FFC, dstrd) is None
    if dstrd:
        assert spec.doorbell_of(0x1002, dstrd) is None


def test_cap_fields():
    cap = spec.make_cap(mqes=1023, dstrd=3)
    assert spec.cap_mqes(cap) == 1023 and spec.cap_dstrd(cap) == 3


def _memory(pages: dict[int, bytes]):
    def read(addr, n):
        base = addr - addr % PAGE
        return pages[base][addr - base : addr - base + n]

    return read


def test_prp_one_and_two_pages():
    nothing = _memory({})
    assert prp_pieces(0x5000 + 512, 0, 1024, nothing) == [(0x5200, 1024)]
    assert prp_pieces(0x5000 + 3584, 0x9000, 1024, nothing) == [(0x5E00, 512), (0x9000, 512)]
    with pytest.raises(PrpError) as e:
        prp_pieces(0x5000 + 3584, 0x9004, 1024, nothing)
    assert e.value.status == spec.SC_PRP_OFFSET_INVALID
    with pytest.raises(PrpError):
        prp_pieces(0x5002, 0, 8, nothing)


@pytest.mark.parametrize("pages", [3, 512, 513, 1100])
def test_prp_lists_chain_across_list_pages(pages):
    data = [0x100_0000 + 2 * i * PAGE for i in range(pages)]
    lists = [0x900_0000 + i * PAGE for i in range(list_pages_needed(pages))]
    written = build_prp_list(data[1:], lists)
    assert len(written) == len(lists)
    mem = _memory({a: raw.ljust(PAGE, b"\0") for a, raw in written.items()})
    got = prp_pieces(data[0], lists[0], pages * PAGE, mem)
    assert got == [(a, PAGE) for a in data]


def test_prp_list_entry_with_an_offset_is_refused():
    lists = {0x7000: struct.pack("<3Q", 0x2000, 0x3008, 0x4000).ljust(PAGE, b"\0")}
    with pytest.raises(PrpError):
        prp_pieces(0x1000, 0x7000, 4 * PAGE, _memory(lists))


def test_guard_adds_the_offset_and_rejects_outside_the_window():
    d = QueueDomain("vm-a", nsid=1, offset=1000, length=100)
    assert d.translate(1, 0, 1) == 1000
    assert d.translate(1, 99, 1) == 1099
    for slba, n in ((99, 2), (100, 1), (-1, 1), (2**40, 1)):
        with pytest.raises(GuardRejection) as e:
            d.translate(1, slba, n)
        assert e.value.status == spec.SC_LBA_OUT_OF_RANGE
    with pytest.raises(GuardRejection) as e:
        d.translate(2, 0, 1)
    assert e.value.status == spec.SC_INVALID_NAMESPACE


def test_guard_address_space_keeps_owners_apart():
    a = QueueDomain("a", 1, 0, 10, asid=1)
    b = QueueDomain("b", 1, 10, 10, asid=2)
    assert a.dma_address(0x1000) != b.dma_address(0x1000)
    # A cannot name B's IOVA: it is outside A's address bits
    with pytest.raises(GuardRejection):
        a.dma_address(b.dma_address(0x1000))
    assert QueueDomain("host", 1, 0, 10).dma_address(1 << ADDRESS_BITS) == 1 << ADDRESS_BITS
    with pytest.raises(ValueError):
        QueueDomain("x", 1, 0, 0)


def test_guard_address_space_boundary_of_a_non_zero_asid():
    """The owner's last address is the last IOVA of its own space; one more would be the
    first IOVA of the next share's space, and is refused."""
    owner, nxt = QueueDomain("a", 1, 0, 10, asid=3), QueueDomain("b", 1, 10, 10, asid=4)
    last = (1 << ADDRESS_BITS) - 1
    assert owner.dma_address(last) == asid_base(4) - 1
    assert owner.dma_address(0) == asid_base(3)
    assert nxt.dma_address(0) == asid_base(4)
    for address in (1 << ADDRESS_BITS, -1):
        with pytest.raises(GuardRejection) as e:
            owner.dma_address(address)
        assert e.value.status == spec.SC_DATA_TRANSFER_ERROR


@pytest.mark.parametrize("pairs", [1, 3])
def test_share_book_adopts_what_it_would_allocate_and_refuses_overlaps(pairs):
    from vmlend.errors import ConfigError
    from vmlend.nvme.shares import Geometry, ShareBook

    for geometry in (Geometry(511, 0, 32, 10_000), Geometry(4000, 0, 32, 10_000)):
        planner = ShareBook(geometry)
        made = [planner.allocate(f"vm{i}", pairs, 100) for i in range(3)]
        book = ShareBook(geometry)
        for share in made:
            book.adopt(share)
        with pytest.raises(ConfigError):
            book.adopt(msgspec.structs.replace(made[0], name="again"))
        assert book.allocate("next", 1, 10).lba_offset == 300


@pytest.mark.parametrize("geometry_qps", [511, 4000])  # trap mode, page mode
def test_a_share_with_a_backup_path_takes_twice_the_queue_ids_and_vectors(geometry_qps):
    from vmlend.errors import ConfigError
    from vmlend.nvme.shares import Geometry, ShareBook

    book = ShareBook(Geometry(geometry_qps, 0, 32, 10_000))
    a = book.allocate("a", 2, 100, paths=2)
    assert (a.paths, a.span, a.asids) == (2, 4, (1, 2))
    assert [a.real_qid(g) for g in (1, 2)] == [a.qid_base + 1, a.qid_base + 2]
    assert [a.backup_qid(g) for g in (1, 2)] == [a.qid_base + 3, a.qid_base + 4]
    assert [a.backup_vector(v) for v in (1, 2)] == [a.vector_base + 2, a.vector_base + 3]
    assert a.backup_guest_vector(a.backup_vector(2)) == 2
    assert a.guest_vector(a.backup_vector(1)) is None  # a backup vector is not a primary one
    b = book.allocate("b", 1, 100)
    # nothing of b overlaps a's backup queue ids, vectors or address space
    assert b.vector_base == a.vector_base + 4 and b.asid == 3
    assert b.qid_base + 1 > a.qid_base + 4
    assert book.by_real_vector(a.backup_vector(1)) == a
    again = ShareBook(book.geometry, [b])
    with pytest.raises(ConfigError, match="overlaps"):  # b's address space is a's backup's
        again.adopt(msgspec.structs.replace(a, asid=9, backup_asid=b.asid))
    with pytest.raises(ConfigError, match="1 or 2 paths"):
        book.allocate("c", 1, 10, paths=3)
    with pytest.raises(ValueError, match="no backup path"):
        b.backup_qid(1)


def test_a_share_record_from_before_backup_paths_reads_as_one_path():
    from vmlend.nvme.shares import Geometry, Share, ShareBook

    share = ShareBook(Geometry(511, 0, 32, 10_000)).allocate("a", 1, 10, paths=2)
    assert Share.from_record(share.record()) == share
    old = {k: v for k, v in share.record().items() if k not in ("paths", "backup_asid")}
    assert Share.from_record(old).paths == 1 and Share.from_record(old).asids == (share.asid,)
