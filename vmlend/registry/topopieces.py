"""The topology as the registry stores it: one generation's content, split into pieces, and
the head that names the generation (pure: no I/O).

A topology of 4,096 nodes x 16 devices is ~30 MB (its TOML text and compiled form), far over
what etcd takes in one request (1.5 MiB and 128 operations by default). So a new topology is
written as a *generation*: its content (``StoredTopology``, msgpack) cut into pieces of
``PIECE_BYTES``, written under a prefix of their own in as many requests as they need, and
then one small *head* (``TopologyHead``) names the generation, with the sha256 of the content
and the digest of the TOML text. A reader reads the head, then the pieces it names, and uses
them only when their bytes hash to the head's sha256: a mix of two generations, a piece lost
or damaged, cannot pass. SQLite stores the same pieces and head (``topology_pieces``).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from vmlend.errors import StateRecordError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vmlend.registry.records import DeviceRecord, TopologyRecord
    from vmlend.topology.model import Topology

#: The format of the head and of the content it names. Another format is not read.
PIECES_FORMAT = "vmlend-topology-pieces/1"

#: The size of one piece: two of them and their keys stay well under etcd's default request
#: limit of 1.5 MiB (``--max-request-bytes``).
PIECE_BYTES = 512 * 1024

#: A generation name: what ``new_generation`` makes (hex), so it is one key level in etcd.
_GENERATION = re.compile(r"^[0-9a-f]{8,64}$")


class StoredTopology(msgspec.Struct, frozen=True, array_like=True):
    """One generation's content: the topology record and each node's and device's initial
    state (nodes up; devices with their lender and whether they are lent, by hex fdid)."""

    name: str
    source: str
    digest: str  # sha256 of ``text``
    created: float
    nodes: list[str]
    devices: dict[str, tuple[str, bool]]
    compiled: bytes | None  # ``vmlend.topology.compiled``; None: parse the text
    text: str  # the TOML: the source of truth


class _Skeleton(msgspec.Struct, frozen=True, array_like=True):
    """``StoredTopology``'s layout, its large fields left undecoded (``StoredView``)."""

    name: str
    source: str
    digest: str
    created: float
    nodes: msgspec.Raw
    devices: msgspec.Raw
    compiled: msgspec.Raw
    text: msgspec.Raw


_T = TypeVar("_T")


class StoredView:
    """One generation's content as a reader sees it: its small fields decoded, the large
    ones (the nodes, each device's initial state, the compiled form, the TOML) decoded on
    first use. A command that lists one lender's devices, or a hook call, needs the compiled
    form and a few device states; at 1,024 nodes x 16 devices decoding the 16,384 states
    alone took ~10 ms. The bytes were verified against the head's sha256 (``join``)."""

    def __init__(self, where: str, content: _Skeleton | StoredTopology) -> None:
        self._where = where
        self._content = content
        self.name = content.name
        self.source = content.source
        self.digest = content.digest
        self.created = content.created

    def _field(self, value: object, kind: type[_T]) -> _T:
        if not isinstance(value, msgspec.Raw):
            return value  # type: ignore[return-value]  # a StoredTopology's: decoded already
        try:
            return msgspec.msgpack.decode(value, type=kind)
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as e:
            raise _damaged(self._where, f"its content does not decode ({e})") from None

    @functools.cached_property
    def nodes(self) -> list[str]:
        return self._field(self._content.nodes, list[str])

    @functools.cached_property
    def node_set(self) -> frozenset[str]:
        return frozenset(self.nodes)

    @functools.cached_property
    def devices(self) -> dict[str, tuple[str, bool]]:
        return self._field(self._content.devices, dict[str, tuple[str, bool]])

    @functools.cached_property
    def compiled(self) -> bytes | None:
        return self._field(self._content.compiled, bytes | None)  # type: ignore[arg-type]

    @functools.cached_property
    def text(self) -> str:
        return self._field(self._content.text, str)

    @functools.cached_property
    def _topology(self) -> Topology | None:
        from vmlend.topology.compiled import decode_compiled

        return decode_compiled(self.compiled, self.digest)

    def device_default(self, fdid: int) -> tuple[str, bool] | None:
        """Device ``fdid``'s initial lender and whether it was lent. ``fabric init`` stores
        them as its topology's own (each ``DeviceSpec``'s ``lender`` and ``lent``), so the
        compiled topology answers for one device without decoding every device's state;
        without a usable compiled form, the states themselves do."""
        topology = self._topology
        if topology is None:
            return self.devices.get(f"{fdid:#x}")
        if not topology.has_device(fdid):
            return None
        spec = topology.device(fdid)
        return spec.lender, spec.lent

    def whole(self) -> StoredTopology:
        return StoredTopology(
            self.name,
            self.source,
            self.digest,
            self.created,
            self.nodes,
            self.devices,
            self.compiled,
            self.text,
        )


class TopologyHead(msgspec.Struct, frozen=True):
    """What names the current generation: its pieces' count and total size, the sha256 of
    their bytes, and the digest of the TOML text (what every transaction compares)."""

    format: str
    generation: str
    digest: str
    sha256: str
    size: int
    pieces: int


def pack(stored: StoredTopology) -> bytes:
    return msgspec.msgpack.encode(stored)


def split(blob: bytes, size: int = PIECE_BYTES) -> list[bytes]:
    """``blob`` in pieces of ``size`` bytes (the last one shorter; one piece when empty)."""
    return [blob[i : i + size] for i in range(0, len(blob), size)] or [b""]


def head_of(generation: str, stored: StoredTopology, blob: bytes, pieces: int) -> TopologyHead:
    return TopologyHead(
        PIECES_FORMAT,
        generation,
        stored.digest,
        hashlib.sha256(blob).hexdigest(),
        len(blob),
        pieces,
    )


def encode_head(head: TopologyHead) -> bytes:
    return msgspec.json.encode(head)


def _damaged(where: str, problem: str) -> StateRecordError:
    return StateRecordError(
        "topology",
        where,
        f"{problem}; run 'vmlend fabric init --replace --topology FILE' to store it again",
    )


def decode_head(raw: bytes, where: str) -> TopologyHead:
    """The head stored at ``where``; ``StateRecordError`` when it is not one of this format."""
    try:
        head = msgspec.json.decode(raw, type=TopologyHead)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        raise _damaged(where, f"not a topology head ({e})") from None
    if head.format != PIECES_FORMAT:
        raise _damaged(where, f"of format {head.format!r}, not {PIECES_FORMAT!r}")
    if not _GENERATION.match(head.generation) or head.pieces < 1 or head.size < 0:
        raise _damaged(where, "a head naming no valid generation")
    return head


def join(head: TopologyHead, pieces: list[bytes]) -> bytes:
    """The generation's content from its pieces, in order; ``StateRecordError`` unless there
    are as many as the head says and their bytes hash to its sha256."""
    where = f"generation {head.generation}"
    if len(pieces) != head.pieces:
        raise _damaged(where, f"{len(pieces)} of its {head.pieces} pieces found")
    blob = b"".join(pieces)
    if len(blob) != head.size or hashlib.sha256(blob).hexdigest() != head.sha256:
        raise _damaged(where, "its pieces do not hash to what its head says")
    return blob


#: The most bytes a head may name: the TOML's cap (64 MiB) with its compiled form, and room.
#: A head naming more is damaged; ``assemble`` does not allocate what it names.
MAX_BYTES = 256 << 20


def assemble(head: TopologyHead, pieces: Iterable[tuple[object, object]]) -> bytes | bytearray:
    """``join`` for pieces read one after the other (``(n, bytes)``, in order): each is copied
    into one buffer of the head's size and hashed as it comes, so a reader holds the content
    once, not its pieces and their join too (13 MB of fresh memory at 1,024 nodes, in every
    process). ``StateRecordError`` unless the pieces are numbered 0, 1, ..., as many as the
    head says, and their bytes hash to its sha256."""
    where = f"generation {head.generation}"
    if head.size > MAX_BYTES:
        raise _damaged(where, f"its head names {head.size} bytes, more than any topology")
    if head.pieces == 1:
        # one piece is the content itself: used as it is, not copied (64 nodes: 0.4 MB)
        rows = list(itertools.islice(pieces, 2))
        if any(n != i or not isinstance(p, bytes) for i, (n, p) in enumerate(rows)):
            raise _damaged(where, "its piece 0 is missing or not bytes")
        return join(head, [p for _n, p in rows if isinstance(p, bytes)])
    out = bytearray(head.size)
    digest = hashlib.sha256()
    at = count = 0
    for n, piece in pieces:
        if n != count or not isinstance(piece, bytes):
            raise _damaged(where, f"its piece {count} is missing or not bytes")
        if at + len(piece) > head.size:
            raise _damaged(where, "its pieces do not hash to what its head says")
        out[at : at + len(piece)] = piece
        digest.update(piece)
        at += len(piece)
        count += 1
    if count != head.pieces:
        raise _damaged(where, f"{count} of its {head.pieces} pieces found")
    if at != head.size or digest.hexdigest() != head.sha256:
        raise _damaged(where, "its pieces do not hash to what its head says")
    return out


def unpack(head: TopologyHead, blob: bytes | bytearray) -> StoredView:
    """The content of a verified ``blob`` (``join``); it must describe the head's digest.
    Its large fields are decoded when first used (``StoredView``)."""
    where = f"generation {head.generation}"
    try:
        skeleton = msgspec.msgpack.decode(blob, type=_Skeleton)
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise _damaged(where, f"its content does not decode ({e})") from None
    if skeleton.digest != head.digest:
        raise _damaged(where, "its content is of another topology than its head names")
    return StoredView(where, skeleton)


def new_generation() -> str:
    """A fresh generation name: two writers never write the same one."""
    import secrets

    return secrets.token_hex(8)


def of_record(
    rec: TopologyRecord, nodes: Iterable[str], devices: Iterable[DeviceRecord]
) -> StoredTopology:
    """The generation's content for installing ``rec`` with these nodes and devices (each
    device's initial lender and whether it is lent: the defaults a record overrides)."""
    return StoredTopology(
        rec.name,
        rec.source,
        rec.digest,
        rec.created,
        list(nodes),
        {f"{d.fdid:#x}": (d.lender, bool(d.lent)) for d in devices},
        rec.compiled,
        rec.text,
    )


def legacy(record: dict[str, Any]) -> StoredTopology:
    """The content of an etcd ``topology/record`` as vmlend wrote it before pieces (JSON).
    A damaged record raises what ``msgspec.convert`` or a missing key raises."""
    from vmlend.registry.etcd_keys import compiled_of

    def field(key: str, kind: Any) -> Any:
        return msgspec.convert(record[key], kind)

    return StoredTopology(
        field("name", str),
        field("source", str),
        field("digest", str),
        field("created", float),
        msgspec.convert(record.get("nodes", []), list[str]),
        msgspec.convert(record.get("devices", {}), dict[str, tuple[str, bool]]),
        compiled_of(record),
        field("text", str),
    )
