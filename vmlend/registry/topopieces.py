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

Format 2 (``PIECES_FORMAT``) makes the content *addressable* and verifiable in parts: it starts
with a small header (``_Layout``) saying where each large field lies, and the head's sha256 is
that of the digests of its 16 KiB chunks (``vmlend.topology.chunked``). So a reader that has
the content at hand (a host's copy, mapped) verifies and decodes only the chunks a call reads:
the header, a few index entries and records, a few kilobytes whatever the fabric's size.
Format 1 (one msgpack array, one sha256 of all its bytes) is still read, whole.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgspec

from vmlend.errors import StateRecordError
from vmlend.topology.chunked import CHUNK_BYTES, Plain, Readable, Window, digests_of, root_of
from vmlend.topology.layout import Span, header_before

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vmlend.registry.records import DeviceRecord, TopologyRecord
    from vmlend.topology.model import Topology

#: The format of the head and of the content it names, as written. ``FORMATS`` are read.
PIECES_FORMAT = "vmlend-topology-pieces/2"
#: Format 1: the content one msgpack array, the head's sha256 that of all its bytes.
PIECES_FORMAT_1 = "vmlend-topology-pieces/1"
FORMATS = frozenset({PIECES_FORMAT, PIECES_FORMAT_1})

#: The size of one piece: two of them and their keys stay well under etcd's default request
#: limit of 1.5 MiB (``--max-request-bytes``). A multiple of the verified chunk's size, so a
#: chunk lies within one piece (a chunk of a host's copy is read again from its piece).
PIECE_BYTES = 512 * 1024
assert PIECE_BYTES % CHUNK_BYTES == 0

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


class _Layout(msgspec.Struct, frozen=True, array_like=True):
    """The header of a format-2 content: its small fields, and where its large ones lie
    (``_FIELDS``: the nodes and the device states as msgpack, the compiled form as it is
    (``compiled`` False: none), the TOML as UTF-8), one after the other after the header."""

    name: str
    source: str
    digest: str
    created: float
    compiled: bool
    spans: tuple[tuple[int, int], ...]


#: The large fields of a format-2 content, in order.
_FIELDS = ("nodes", "devices", "compiled", "text")

#: A format-2 content: ``len(header) | header | fields``, the length a big-endian u32.
_PREFIX = 4

_T = TypeVar("_T")


class StoredView:
    """One generation's content as a reader sees it: its small fields decoded, the large
    ones (the nodes, each device's initial state, the compiled form, the TOML) decoded on
    first use. A command that lists one lender's devices, or a hook call, needs the compiled
    form's header and a few of its records; at 1,024 nodes x 16 devices decoding the 16,384
    states alone took ~10 ms. Format 1's bytes were verified whole (``join``); format 2's are
    read through a ``Readable`` that verifies them, whole or chunk by chunk (``unpack``)."""

    def __init__(
        self,
        where: str,
        content: _Skeleton | StoredTopology | _Layout,
        data: Readable | None = None,
    ) -> None:
        self._where = where
        self._content = content
        self._data = data  # format 2: the content's bytes
        self.name = content.name
        self.source = content.source
        self.digest = content.digest
        self.created = content.created

    def _span(self, field: str) -> Window:
        assert isinstance(self._content, _Layout) and self._data is not None
        start, end = self._content.spans[_FIELDS.index(field)]
        return Window(self._data, start, end)

    def _field(self, field: str, kind: type[_T]) -> _T:
        value: object
        if isinstance(self._content, _Layout):
            value = self._span(field).whole()
        else:
            value = getattr(self._content, field)
            if not isinstance(value, msgspec.Raw):
                return value  # type: ignore[return-value]  # a StoredTopology's: decoded already
        try:
            return msgspec.msgpack.decode(value, type=kind)
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as e:
            raise _damaged(self._where, f"its content does not decode ({e})") from None

    @functools.cached_property
    def nodes(self) -> list[str]:
        return self._field("nodes", list[str])

    @functools.cached_property
    def node_set(self) -> frozenset[str]:
        return frozenset(self.nodes)

    @functools.cached_property
    def devices(self) -> dict[str, tuple[str, bool]]:
        return self._field("devices", dict[str, tuple[str, bool]])

    @functools.cached_property
    def compiled_view(self) -> Readable | None:
        """The compiled form, read as it is used (format 2), or None without one."""
        if isinstance(self._content, _Layout):
            return self._span("compiled") if self._content.compiled else None
        compiled = self.compiled
        return None if compiled is None else Plain(compiled)

    @functools.cached_property
    def compiled(self) -> bytes | None:
        if isinstance(self._content, _Layout):
            view = self.compiled_view
            return None if view is None else bytes(view.view(0, len(view)))
        return self._field("compiled", bytes | None)  # type: ignore[arg-type]

    @functools.cached_property
    def text(self) -> str:
        if not isinstance(self._content, _Layout):
            return self._field("text", str)
        try:
            return str(self._span("text").whole(), "utf-8")
        except UnicodeDecodeError as e:
            raise _damaged(self._where, f"its text is not UTF-8 ({e})") from None

    @functools.cached_property
    def _topology(self) -> Topology | None:
        from vmlend.topology.compiled import decode_compiled, decode_compiled_view

        if isinstance(self._content, _Layout):
            view = self.compiled_view
            return None if view is None else decode_compiled_view(view, self.digest)
        return decode_compiled(self.compiled, self.digest)

    def topology(self) -> Topology | None:
        """The compiled topology, None without a usable one (then its text is parsed)."""
        return self._topology

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
    their bytes (format 2: of their chunks' digests), and the digest of the TOML text (what
    every transaction compares)."""

    format: str
    generation: str
    digest: str
    sha256: str
    size: int
    pieces: int


def pack(stored: StoredTopology) -> bytes:
    """``stored`` as a generation's content of format ``PIECES_FORMAT`` (which tests of what
    an older vmlend wrote set to format 1)."""
    if PIECES_FORMAT == PIECES_FORMAT_1:
        return msgspec.msgpack.encode(stored)
    enc = msgspec.msgpack.Encoder()
    fields = (
        enc.encode(stored.nodes),
        enc.encode(stored.devices),
        stored.compiled or b"",
        stored.text.encode(),
    )

    def header(spans: tuple[Span, ...]) -> bytes:
        layout = _Layout(
            stored.name,
            stored.source,
            stored.digest,
            stored.created,
            stored.compiled is not None,
            spans,
        )
        return enc.encode(layout)

    head = header_before(_PREFIX, [len(f) for f in fields], header)
    return len(head).to_bytes(4, "big") + head + b"".join(fields)


class Verified(NamedTuple):
    """A generation's content and, for format 2, its chunks' digests (which hash to its
    head's sha256): what ``TopologyCache.put`` keeps, so the content hashed once to verify
    it is not hashed again to copy it (6.6 MB at 1,024 nodes)."""

    blob: bytes | bytearray
    digests: bytes | None  # format 1: None (its sha256 is that of the whole content)


def _sha256(fmt: str, blob: bytes | bytearray | memoryview) -> tuple[str, bytes | None]:
    """The sha256 a head of format ``fmt`` names for ``blob``, and the digests it is the
    root of (format 2; None for format 1)."""
    if fmt == PIECES_FORMAT_1:
        return hashlib.sha256(blob).hexdigest(), None
    digests = digests_of(blob)
    return root_of(digests), digests


def split(blob: bytes, size: int = PIECE_BYTES) -> list[bytes]:
    """``blob`` in pieces of ``size`` bytes (the last one shorter; one piece when empty)."""
    return [blob[i : i + size] for i in range(0, len(blob), size)] or [b""]


def head_of(generation: str, stored: StoredTopology, blob: bytes, pieces: int) -> TopologyHead:
    """The head naming ``blob`` (``pack``'s) as ``generation``."""
    return named(generation, stored, blob, pieces)[0]


def named(
    generation: str, stored: StoredTopology, blob: bytes, pieces: int
) -> tuple[TopologyHead, Verified]:
    """``head_of``, and ``blob`` with the digests its sha256 was computed from."""
    fmt = PIECES_FORMAT
    sha256, digests = _sha256(fmt, blob)
    head = TopologyHead(fmt, generation, stored.digest, sha256, len(blob), pieces)
    return head, Verified(blob, digests)


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
    if head.format not in FORMATS:
        raise _damaged(where, f"of format {head.format!r}, not {PIECES_FORMAT!r}")
    if not _GENERATION.match(head.generation) or head.pieces < 1 or head.size < 0:
        raise _damaged(where, "a head naming no valid generation")
    return head


def join(head: TopologyHead, pieces: list[bytes]) -> bytes:
    """The generation's content from its pieces, in order; ``StateRecordError`` unless there
    are as many as the head says and their bytes hash to its sha256."""
    blob = join_verified(head, pieces).blob
    assert isinstance(blob, bytes)
    return blob


def join_verified(head: TopologyHead, pieces: list[bytes]) -> Verified:
    """``join``, with the digests the content was verified by."""
    where = f"generation {head.generation}"
    if len(pieces) != head.pieces:
        raise _damaged(where, f"{len(pieces)} of its {head.pieces} pieces found")
    blob = b"".join(pieces)
    sha256, digests = _sha256(head.format, blob)
    if len(blob) != head.size or sha256 != head.sha256:
        raise _damaged(where, "its pieces do not hash to what its head says")
    return Verified(blob, digests)


#: The most bytes a head may name: the TOML's cap (64 MiB) with its compiled form, and room.
#: A head naming more is damaged; ``assemble`` does not allocate what it names.
MAX_BYTES = 256 << 20


def assemble(head: TopologyHead, pieces: Iterable[tuple[object, object]]) -> bytes | bytearray:
    """``join`` for pieces read one after the other (``(n, bytes)``, in order): each is copied
    into one buffer of the head's size and hashed as it comes, so a reader holds the content
    once, not its pieces and their join too (13 MB of fresh memory at 1,024 nodes, in every
    process). ``StateRecordError`` unless the pieces are numbered 0, 1, ..., as many as the
    head says, and their bytes hash to its sha256."""
    return assemble_verified(head, pieces).blob


def assemble_verified(head: TopologyHead, pieces: Iterable[tuple[object, object]]) -> Verified:
    """``assemble``, with the digests the content was verified by."""
    where = f"generation {head.generation}"
    if head.size > MAX_BYTES:
        raise _damaged(where, f"its head names {head.size} bytes, more than any topology")
    if head.pieces == 1:
        # one piece is the content itself: used as it is, not copied (64 nodes: 0.4 MB)
        rows = list(itertools.islice(pieces, 2))
        if any(n != i or not isinstance(p, bytes) for i, (n, p) in enumerate(rows)):
            raise _damaged(where, "its piece 0 is missing or not bytes")
        return join_verified(head, [p for _n, p in rows if isinstance(p, bytes)])
    out = bytearray(head.size)
    whole = head.format == PIECES_FORMAT_1
    digest = hashlib.sha256()
    at = count = 0
    for n, piece in pieces:
        if n != count or not isinstance(piece, bytes):
            raise _damaged(where, f"its piece {count} is missing or not bytes")
        if at + len(piece) > head.size:
            raise _damaged(where, "its pieces do not hash to what its head says")
        out[at : at + len(piece)] = piece
        if whole:
            digest.update(piece)
        at += len(piece)
        count += 1
    if count != head.pieces:
        raise _damaged(where, f"{count} of its {head.pieces} pieces found")
    found, digests = (digest.hexdigest(), None) if whole else _sha256(head.format, out)
    if at != head.size or found != head.sha256:
        raise _damaged(where, "its pieces do not hash to what its head says")
    return Verified(out, digests)


def unpack(head: TopologyHead, blob: bytes | bytearray | Readable) -> StoredView:
    """The content of ``blob``: verified whole (``join``, ``assemble``), or (format 2) a
    ``Readable`` verifying each chunk as it is read (a host's copy: ``topocache``). It must
    describe the head's digest. Its large fields are decoded when first used
    (``StoredView``)."""
    where = f"generation {head.generation}"
    try:
        if head.format == PIECES_FORMAT_1:
            if not isinstance(blob, bytes | bytearray):
                raise TypeError("a format-1 content is verified whole: give its bytes")
            content: _Skeleton | _Layout = msgspec.msgpack.decode(blob, type=_Skeleton)
            data = None
        else:
            data = Plain(blob) if isinstance(blob, bytes | bytearray) else blob
            size = int.from_bytes(data.view(0, _PREFIX), "big")
            layout = msgspec.msgpack.decode(data.view(_PREFIX, _PREFIX + size), type=_Layout)
            _check_spans(layout.spans, _PREFIX + size, len(data))
            content = layout
    except (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise _damaged(where, f"its content does not decode ({e})") from None
    if content.digest != head.digest:
        raise _damaged(where, "its content is of another topology than its head names")
    return StoredView(where, content, data)


def _check_spans(spans: tuple[tuple[int, int], ...], start: int, size: int) -> None:
    """The fields lie one after the other from the header's end to the content's."""
    if len(spans) != len(_FIELDS):
        raise ValueError(f"{len(spans)} fields, not {len(_FIELDS)}")
    at = start
    for first, end in spans:
        if first != at or end < first:
            raise ValueError("its fields are not one after the other")
        at = end
    if at != size:
        raise ValueError("its fields do not end where it does")


def rewritten(stored: StoredTopology) -> StoredTopology:
    """``stored`` to be written again in this vmlend's format: with its compiled form
    compiled again from its text when this vmlend cannot read the one it has (another
    format: a generation of format 1 holds compiled format 6). A text that does not parse is
    left as it is, compiled form and all: opening the fabric reports it."""
    from vmlend.errors import TopologyError
    from vmlend.topology.compiled import compile_topology, decode_compiled

    if decode_compiled(stored.compiled, stored.digest) is not None:
        return stored
    from vmlend.topology.parse import parse_topology

    try:
        topology = parse_topology(stored.text, stored.source)
    except TopologyError:
        return stored
    compiled = compile_topology(topology, stored.digest)
    return msgspec.structs.replace(stored, compiled=compiled)


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
        rec.compiled_bytes(),
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
