"""The host's copy of a cluster registry's topology: used only when it is the current
generation's and its bytes hash to what the registry's head says; anything else is read past
and rewritten, never trusted."""

from __future__ import annotations

import hashlib
import os
import types
from pathlib import Path

import msgspec
import pytest

from tests.support.daemon_marks import REGISTRIES
from tests.support.simfabric import fabric_topology, small_topology, star_topology
from vmlend.errors import DamagedCopyError
from vmlend.hostenv import HostEnv
from vmlend.registry import topopieces
from vmlend.registry.etcd_gateway import EtcdGateway
from vmlend.registry.records import TopologyRecord
from vmlend.registry.topocache import CACHE_FORMAT, TopologyCache
from vmlend.wiring.fabric import init_fabric, open_fabric


def _generation(text: str):
    rec = TopologyRecord("t", "t.toml", text, "d-" + text[:40], "", 1.0, None)
    stored = topopieces.of_record(rec, ["a"], [])
    blob = topopieces.pack(stored)
    head = topopieces.head_of(topopieces.new_generation(), stored, blob, 1)
    return head, blob


def test_a_copy_comes_back_only_for_its_own_head(tmp_path):
    cache = TopologyCache(tmp_path / "topology")
    head, blob = _generation("x")
    other, _ = _generation("x")  # same content, another generation
    assert cache.get("etcd://a/lab", head) is None  # nothing kept yet
    cache.put("etcd://a/lab", head, blob)
    assert _content(cache.get("etcd://a/lab", head)) == blob
    assert cache.get("etcd://a/lab", other) is None
    assert cache.get("etcd://b/lab", head) is None  # another registry's file


def _content(found) -> bytes:
    assert found is not None
    return bytes(found.view(0, len(found)))


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data.replace(CACHE_FORMAT, b"vmlend-topology-cache/0"),
        lambda data: data[: len(data) // 2],
        lambda data: b"",
        lambda data: b"\x80\x04\x95 a pickle, say",
    ],
)
def test_a_damaged_or_foreign_copy_is_not_used(tmp_path, damage):
    cache = TopologyCache(tmp_path)
    head, blob = _generation("x")
    cache.put("r", head, blob)
    path = cache.path("r")
    path.write_bytes(damage(path.read_bytes()))
    assert cache.get("r", head) is None


def test_a_chunk_that_does_not_match_its_digest_is_refused_where_read_and_the_copy_removed(
    tmp_path,
):
    cache = TopologyCache(tmp_path)
    head, blob = _generation("x" * 40_000)  # three chunks: the TOML fills the last two
    cache.put("r", head, blob)
    path = cache.path("r")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # one bit of the last chunk
    path.write_bytes(bytes(data))
    found = cache.get("r", head)
    assert found is not None  # only the digests are checked when the copy is opened
    stored = topopieces.unpack(head, found)
    assert stored.name == "t" and stored.nodes == ["a"]  # the first chunk is sound
    with pytest.raises(DamagedCopyError, match=r"copy of the topology .* is damaged.*again"):
        _ = stored.text
    assert not path.exists()  # the next process reads the registry
    with pytest.raises(DamagedCopyError, match="damaged"):
        found.view(len(found) - 1, len(found))  # refused every time, not only once


def test_bytes_changed_in_the_copy_after_it_was_opened_are_not_used(tmp_path):
    # whoever may write the file can change it under a process that opened it: a chunk
    # checked before is kept as it was checked; a chunk changed before its check, digest and
    # all, does not match the digests checked against the head at the open
    cache = TopologyCache(tmp_path)
    head, blob = _generation("x" * 40_000)
    cache.put("r", head, blob)
    path = cache.path("r")
    found = cache.get("r", head)
    assert found is not None
    first = bytes(found.view(0, 100))  # checked, then kept in the process's memory
    data = bytearray(path.read_bytes())
    digests_at = len(data) - len(blob) - 3 * 32
    forged = b"y" * (len(blob) - 2 * 16384)
    data[-len(forged) :] = forged  # the last chunk's bytes and, below, its digest
    data[digests_at + 64 : digests_at + 96] = hashlib.sha256(forged).digest()
    data[len(data) - len(blob) : len(data) - len(blob) + 100] = b"z" * 100
    path.write_bytes(bytes(data))  # in place: the same file the process has open
    assert bytes(found.view(0, 100)) == first
    with pytest.raises(DamagedCopyError):
        found.view(len(found) - 1, len(found))
    cache.put("r", head, blob)
    again = cache.get("r", head)
    assert again is not None
    os.truncate(path, 0)  # truncated in place: short reads, refused, not a bus error
    with pytest.raises(DamagedCopyError):
        again.view(16384, 16385)


def test_a_chunk_that_does_not_match_is_read_from_the_registrys_pieces(tmp_path):
    cache = TopologyCache(tmp_path)
    head, blob = _generation("x" * 40_000)
    cache.put("r", head, blob)
    path = cache.path("r")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    asked = []

    def pieces(start, length):
        asked.append((start, length))
        return blob[start : start + length]

    stored = cache.open("r", head, pieces)
    assert stored is not None and stored.text == "x" * 40_000
    assert asked == [(2 * 16384, len(blob) - 2 * 16384)]  # the last chunk alone
    assert not path.exists()  # the next process reads the pieces and writes a good copy


def test_a_forged_copy_under_the_right_head_is_not_used(tmp_path):
    # whoever writes the file can copy the head; not content that hashes to its sha256
    cache = TopologyCache(tmp_path)
    head, _blob = _generation("x")
    _other_head, forged = _generation("y")
    cache.put("r", head, forged)
    assert cache.get("r", head) is None


def test_a_copy_put_with_its_verified_digests_is_the_copy_put_without_them(tmp_path):
    head, blob = _generation("x" * 40_000)  # three chunks
    verified = topopieces.join_verified(head, topopieces.split(blob))
    assert verified.digests is not None and len(verified.digests) == 3 * 32
    TopologyCache(tmp_path / "without").put("r", head, blob)
    TopologyCache(tmp_path / "with").put("r", head, bytearray(blob), digests=verified.digests)
    written = TopologyCache(tmp_path / "with").path("r").read_bytes()
    assert written == TopologyCache(tmp_path / "without").path("r").read_bytes()
    assert _content(TopologyCache(tmp_path / "with").get("r", head)) == blob


_FORMAT_1 = topopieces.PIECES_FORMAT_1


@pytest.mark.parametrize(
    "wrong",
    [
        lambda h, blob, d, others: (h, blob, others),
        lambda h, blob, d, others: (h, blob, d[:-32]),
        lambda h, blob, d, others: (h, blob, d[32:64] + d[:32] + d[64:]),
        lambda h, blob, d, others: (h, blob, b""),
        lambda h, blob, d, others: (h, blob + b"x", d),
        lambda h, blob, d, others: (msgspec.structs.replace(h, format=_FORMAT_1), blob, d),
    ],
    ids=["another generation's", "one short", "out of order", "none", "longer blob", "format 1"],
)
def test_digests_that_are_not_the_heads_are_refused_and_nothing_written(tmp_path, wrong):
    # a caller's mistake must not leave a copy whose digests are not what its head names
    cache = TopologyCache(tmp_path)
    head, blob = _generation("x" * 40_000)
    other_head, other = _generation("y" * 40_000)
    digests = topopieces.join_verified(head, [blob]).digests
    others = topopieces.join_verified(other_head, [other]).digests
    put_head, put_blob, put_digests = wrong(head, blob, digests, others)
    with pytest.raises(ValueError, match="digests"):
        cache.put("r", put_head, put_blob, digests=put_digests)
    assert not cache.path("r").exists()


def test_a_link_or_fifo_where_the_copy_goes_is_neither_followed_nor_waited_on(tmp_path):
    cache = TopologyCache(tmp_path)
    head, blob = _generation("x")
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    cache.path("r").symlink_to(target)
    cache.put("r", head, blob)  # refused: not written through the link
    assert target.read_bytes() == b"keep" and cache.get("r", head) is None
    cache.path("r").unlink()
    os.mkfifo(cache.path("r"))
    assert cache.get("r", head) is None  # not opened for reading: no wait


def test_an_unwritable_directory_only_means_no_copy(tmp_path):
    (tmp_path / "file").write_text("")
    cache = TopologyCache(tmp_path / "file" / "topology")  # its parent is not a directory
    head, blob = _generation("x")
    cache.put("r", head, blob)
    assert cache.get("r", head) is None


# --- on a real etcd: what a command reads ------------------------------------------------------
@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """Every key (or range start) the process asks etcd for."""
    seen: list[str] = []
    real_range, real_many = EtcdGateway.range, EtcdGateway.read_many

    def range_(self, key, range_end=None, revision=0):
        seen.append(key)
        return real_range(self, key, range_end, revision)

    def read_many(self, ranges, revision=0):
        seen.extend(k for k, _end in ranges)
        return real_many(self, ranges, revision)

    monkeypatch.setattr(EtcdGateway, "range", range_)
    monkeypatch.setattr(EtcdGateway, "read_many", read_many)
    return seen


def _pieces_read(seen: list[str]) -> list[str]:
    return [k for k in seen if "/topology/gen/" in k or k.endswith("/topology/record")]


def test_a_command_reads_only_the_head_while_the_hosts_copy_is_current(etcd_url, reads):
    init_fabric(etcd_url, star_topology(3, 4), "t.toml")
    cache_dir = HostEnv.from_env().topology_cache
    assert str(cache_dir).startswith(os.environ["VMLEND_ROOT"])  # never the machine's /var
    reads.clear()
    with open_fabric(etcd_url, "h0") as fabric:  # init kept the copy: no piece read
        assert len(fabric.devices()) == 4
    assert _pieces_read(reads) == []
    for path in cache_dir.iterdir():
        path.unlink()
    reads.clear()
    with open_fabric(etcd_url, "h0") as fabric:  # no copy: the pieces, then kept
        assert len(fabric.devices()) == 4
    assert _pieces_read(reads) != []
    reads.clear()
    with open_fabric(etcd_url, "h0") as fabric:
        assert len(fabric.devices()) == 4
    assert _pieces_read(reads) == []


def test_a_damaged_copy_is_read_past_and_rewritten(etcd_url, reads):
    init_fabric(etcd_url, star_topology(3, 4), "t.toml")
    (path,) = HostEnv.from_env().topology_cache.iterdir()
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    reads.clear()
    with open_fabric(etcd_url, "h0") as fabric:  # the chunk read from its piece instead
        assert len(fabric.devices()) == 4
    assert _pieces_read(reads) != [] and not path.exists()
    with open_fabric(etcd_url, "h0") as fabric:  # no copy: the pieces, then a good copy
        assert len(fabric.devices()) == 4
    assert path.read_bytes() == good


@pytest.mark.parametrize("registry", REGISTRIES)
def test_reading_the_registry_and_keeping_a_copy_hashes_the_content_once(
    registry, request, tmp_path, monkeypatch
):
    # it was hashed to verify the pieces and again to write the copy: 2 x 6.6 MB at 1,024 nodes
    from vmlend.topology import chunked

    if registry == "etcd":
        location: str | Path = request.getfixturevalue("etcd_url")
        copies = HostEnv.from_env().topology_cache
    else:
        location = tmp_path / "state.db"
        copies = tmp_path
    init_fabric(location, fabric_topology(32, 16), "t.toml", node="n0")
    with open_fabric(location, "n0"):  # the copy as it is kept (etcd: already by init)
        pass
    (copy,) = (p for p in copies.iterdir() if p.name.endswith("topology"))
    kept = copy.read_bytes()
    copy.unlink()
    hashed = []

    def sha256(data=b""):
        hashed.append(len(data))
        return hashlib.sha256(data)

    monkeypatch.setattr(chunked, "hashlib", types.SimpleNamespace(sha256=sha256))
    with open_fabric(location, "n0") as fabric:  # reads the pieces, keeps the copy
        assert len(fabric.devices("n5")) == 16
    monkeypatch.undo()
    assert copy.read_bytes() == kept
    assert len(kept) > 10 * chunked.CHUNK_BYTES
    assert len(kept) < sum(hashed) < 1.1 * len(kept)


def test_a_new_topology_is_read_once_whatever_the_copy_says(etcd_url, reads):
    init_fabric(etcd_url, star_topology(3, 4), "t.toml")
    (path,) = HostEnv.from_env().topology_cache.iterdir()
    old = path.read_bytes()
    init_fabric(etcd_url, small_topology(), "s.toml", replace=True)
    path.write_bytes(old)  # another host's view: the copy of the generation before
    reads.clear()
    with open_fabric(etcd_url, "b") as fabric:
        assert len(fabric.devices()) == 3 and fabric.topology().name == "small"
    assert _pieces_read(reads) != [] and path.read_bytes() != old
