"""The topology's generations, pure: pieces join into the content their head names, and
nothing else does (a piece missing, damaged, or of another generation)."""

from __future__ import annotations

import msgspec
import pytest

from vmlend.errors import StateRecordError
from vmlend.registry import topopieces
from vmlend.registry.records import DeviceRecord, TopologyRecord
from vmlend.registry.topopieces import StoredTopology


def _stored(text: str) -> StoredTopology:
    rec = TopologyRecord("t", "t.toml", text, f"digest of {text[:8]}", "", 1.0, b"\x01\x02")
    return topopieces.of_record(
        rec, ["a", "b"], [DeviceRecord(0x10, "a", True), DeviceRecord(0x20, "b", False)]
    )


def _generation(text: str, size: int) -> tuple[topopieces.TopologyHead, list[bytes]]:
    stored = _stored(text)
    blob = topopieces.pack(stored)
    pieces = topopieces.split(blob, size)
    return topopieces.head_of(topopieces.new_generation(), stored, blob, len(pieces)), pieces


def test_pieces_join_into_the_content_their_head_names():
    head, pieces = _generation("x" * 5000, 1024)
    assert len(pieces) == head.pieces > 4 and all(len(p) <= 1024 for p in pieces)
    stored = topopieces.unpack(head, topopieces.join(head, pieces))
    assert stored.whole() == _stored("x" * 5000)
    assert stored.devices == {"0x10": ("a", True), "0x20": ("b", False)}
    raw = topopieces.encode_head(head)
    assert topopieces.decode_head(raw, "k") == head


def test_a_mix_of_two_generations_a_missing_or_damaged_piece_is_refused():
    head, pieces = _generation("x" * 5000, 1024)
    _other_head, other = _generation("y" * 5000, 1024)
    damaged = [*pieces[:-1], pieces[-1][:-1] + b"\xff"]
    for bad in ([*pieces[:2], *other[2:]], pieces[:-1], damaged, [*pieces, b""]):
        with pytest.raises(StateRecordError, match=r"fabric init --replace"):
            topopieces.join(head, bad)


@pytest.mark.parametrize("size", [1024, 1 << 20], ids=["pieces", "one piece"])
def test_pieces_read_one_by_one_assemble_into_what_join_gives(size):
    head, pieces = _generation("x" * 5000, size)
    assembled = topopieces.assemble(head, enumerate(pieces))
    assert assembled == topopieces.join(head, pieces)
    assert topopieces.unpack(head, assembled).whole() == _stored("x" * 5000)


@pytest.mark.parametrize("size", [1024, 1 << 20], ids=["pieces", "one piece"])
def test_verified_content_comes_with_the_digests_its_head_names(size, monkeypatch):
    # what a host's copy keeps beside the content (``TopologyCache.put``)
    from vmlend.topology.chunked import digests_of, root_of

    stored = _stored("x" * 40_000)
    blob = topopieces.pack(stored)
    head, named = topopieces.named(topopieces.new_generation(), stored, blob, 1)
    pieces = topopieces.split(blob, size)
    head = msgspec.structs.replace(head, pieces=len(pieces))
    for verified in (
        named,
        topopieces.join_verified(head, pieces),
        topopieces.assemble_verified(head, enumerate(pieces)),
    ):
        assert verified.blob == blob and verified.digests == digests_of(blob)
        assert root_of(verified.digests) == head.sha256
    monkeypatch.setattr(topopieces, "PIECES_FORMAT", topopieces.PIECES_FORMAT_1)
    head, named = topopieces.named(topopieces.new_generation(), stored, blob, len(pieces))
    assert named.digests is None  # format 1: one sha256 of the whole content
    assert topopieces.assemble_verified(head, enumerate(pieces)) == (blob, None)


def test_assembling_refuses_what_join_refuses_and_misnumbered_pieces():
    head, pieces = _generation("x" * 5000, 1024)
    _other_head, other = _generation("y" * 5000, 1024)
    damaged = [*pieces[:-1], pieces[-1][:-1] + b"\xff"]
    numbered = [
        list(enumerate([*pieces[:2], *other[2:]])),  # a mix of two generations
        list(enumerate(pieces[:-1])),  # one missing
        list(enumerate(damaged)),
        list(enumerate([*pieces, b""])),  # one more
        list(enumerate([*pieces[:-1], pieces[-1] + b"\x00"])),  # a byte more
        [(n + 1, p) for n, p in enumerate(pieces)],  # numbered from 1
        [(0, pieces[0]), *((n, p) for n, p in enumerate(pieces) if n != 1)],  # 0, 0, 2, ...
        [(n, "text" if n == 2 else p) for n, p in enumerate(pieces)],  # not bytes
    ]
    for bad in numbered:
        with pytest.raises(StateRecordError, match=r"fabric init --replace"):
            topopieces.assemble(head, bad)


def test_a_generation_of_one_piece_is_refused_for_the_same_damage():
    head, pieces = _generation("x" * 5000, 1 << 20)
    (piece,) = pieces
    for bad in (
        [],
        [(0, piece[:-1] + b"\xff")],
        [(0, piece + b"\x00")],
        [(0, piece), (1, b"")],
        [(1, piece)],
        [(0, "text")],
    ):
        with pytest.raises(StateRecordError, match=r"fabric init --replace"):
            topopieces.assemble(head, bad)


def test_a_head_naming_more_than_any_topology_is_refused_before_allocating_it():
    head, pieces = _generation("x" * 100, 1024)
    huge = msgspec.structs.replace(head, size=1 << 60)
    with pytest.raises(StateRecordError, match="more than any topology"):
        topopieces.assemble(huge, enumerate(pieces))


def test_content_of_another_topology_than_the_head_names_is_refused():
    head, pieces = _generation("x" * 100, 1024)
    blob = topopieces.join(head, pieces)
    other = topopieces.TopologyHead(
        head.format, head.generation, "another digest", head.sha256, head.size, head.pieces
    )
    with pytest.raises(StateRecordError, match="another topology"):
        topopieces.unpack(other, blob)
    with pytest.raises(StateRecordError, match="does not decode"):
        topopieces.unpack(head, b"\x93garbage")
    # a large field is decoded on first use: damage there is the same error, then
    devices = blob.index(msgspec.msgpack.encode({"0x10": ("a", True), "0x20": ("b", False)}))
    damaged = bytearray(blob)
    damaged[devices] = 0xC1  # a byte msgpack never uses
    lazy = topopieces.unpack(head, damaged)
    assert lazy.name == "t" and lazy.nodes == ["a", "b"]
    with pytest.raises(StateRecordError, match="does not decode"):
        _ = lazy.devices


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b'{"format":"vmlend-topology-pieces/0","generation":"00ff00ff","digest":"d",'
        b'"sha256":"s","size":1,"pieces":1}',
        b'{"format":"vmlend-topology-pieces/1","generation":"../../x","digest":"d",'
        b'"sha256":"s","size":1,"pieces":1}',
        b'{"format":"vmlend-topology-pieces/1","generation":"00ff00ff","digest":"d",'
        b'"sha256":"s","size":1,"pieces":0}',
        b"[" * 100_000,
    ],
)
def test_a_head_that_is_not_one_is_a_record_error(raw):
    with pytest.raises(StateRecordError, match="topology"):
        topopieces.decode_head(raw, "topology/generation")


def test_an_empty_content_is_one_piece():
    assert topopieces.split(b"", 8) == [b""]
    assert topopieces.split(b"123456789", 4) == [b"1234", b"5678", b"9"]
