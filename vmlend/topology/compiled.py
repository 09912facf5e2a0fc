"""The compiled form of a topology: the parsed ``Topology`` as msgpack, stored in the registry
next to the TOML it came from, so that opening a fabric parses no TOML (no ``tomllib``, no
validation: about 7 ms of a CLI command or a hook call).

The TOML stays the source of truth; the compiled form is a cache of it. It is trusted only when
its format tag is this code's and it names the digest of the text stored beside it; anything
else (a record an older vmlend wrote, another format, damage) falls back to parsing the text.

From format 4 the topology is stored *sliced* (``vmlend.topology.sliced``): each node's and
each device's record its own msgpack slice, with indexes by name, fdid and lender, so that a
process decodes only the records it asks for. At 1,024 nodes x 16 devices decoding all of them
took ~0.1 s of every command; a hook call or a reserve needs a handful. From format 7 the
blob is *addressable*: a header says where each table lies, so that a reader of a generation
verified chunk by chunk (``vmlend.topology.chunked``) reads the header, the index entries and
the records a call uses, not the 3.5 MB of a 1,024-node topology.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, cast

import msgspec

from vmlend.errors import TopologyError
from vmlend.topology import sliced
from vmlend.topology.chunked import Plain, Readable, Window
from vmlend.topology.layout import Span, header_before
from vmlend.topology.model import DeviceSpec, LinkSpec, NodeSpec, Topology

if TYPE_CHECKING:
    from vmlend.registry.records import TopologyRecord

#: Bump when the same bytes would decode into a different ``Topology``: a change to any Struct
#: reachable from it (tests/unit/topology/test_topology_compiled.py pins their shape) or to
#: what the parser derives from the text. A record of another format is simply parsed from its TOML.
COMPILED_FORMAT = "vmlend-topology/7"

#: What a damaged or foreign blob can raise while msgspec decodes it: besides its own errors,
#: a bad byte inside a string (UnicodeDecodeError, a ValueError) and deep nesting.
_UNDECODABLE = (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError)


class _Header(msgspec.Struct, frozen=True, array_like=True):
    """A compiled topology's header: its format, the digest of the text it came from, the
    topology's small fields, and where each table's bytes lie after it (``_TABLES``): node
    and device records as msgpack slices (``sliced``), their indexes as big-endian u32."""

    format: str
    digest: str  # the registry's digest of the TOML text this was compiled from
    name: str
    source: str
    links: tuple[LinkSpec, ...]
    switch_links: tuple[tuple[str, str], ...]
    node_names: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]  # (start, end) in the blob, one per ``_TABLES``


#: The tables after the header, in order: each NodeSpec's msgpack one after the other and
#: where each ends; each DeviceSpec's, in declaration order, and where each ends; the fdids,
#: sorted, with each one's device position; device positions grouped by lender in node order,
#: and where each node's group ends.
_TABLES = (
    "nodes",
    "node_ends",
    "devices",
    "device_ends",
    "fdids",
    "fdid_pos",
    "lender_pos",
    "lender_ends",
)

#: The blob: ``crc32(rest) | len(header) | header | tables``, lengths big-endian u32. The CRC
#: guards bytes that were not verified otherwise (``decode_compiled``); within a generation
#: read chunk by chunk, each chunk's sha256 does (``decode_compiled_view``), and the CRC,
#: which would read every byte, is not taken.
_PREFIX = 8


def _sliceable(topology: Topology) -> bool:
    """Whether looking a record up by key in the slices answers what the whole tuples would:
    distinct node names and fdids (u32, as parsed), every device's lender a node, every
    adapter named after its node. A topology the parser gives always is; one built in code
    may not be, and is then not compiled."""
    names = [n.name for n in topology.nodes]
    fdids = [d.fdid for d in topology.devices]
    known = set(names)
    return (
        len(known) == len(names)
        and len(set(fdids)) == len(fdids)
        and all(0 <= f < 1 << 32 for f in fdids)
        and all(d.lender in known for d in topology.devices)
        and all(a.node == n.name for n in topology.nodes for a in n.adapters)
    )


def _ends(encoded: list[bytes]) -> bytes:
    out, at = [], 0
    for e in encoded:
        at += len(e)
        out.append(at)
    return sliced.pack_u32(out)


def _pack(topology: Topology, digest: str) -> bytes:
    enc = msgspec.msgpack.Encoder()
    nodes = [enc.encode(n) for n in topology.nodes]
    devices = [enc.encode(d) for d in topology.devices]
    by_fdid = sorted(range(len(topology.devices)), key=lambda i: topology.devices[i].fdid)
    position = {n.name: i for i, n in enumerate(topology.nodes)}
    groups: list[list[int]] = [[] for _ in topology.nodes]
    for i, d in enumerate(topology.devices):
        groups[position[d.lender]].append(i)
    ends, at = [], 0
    for g in groups:
        at += len(g)
        ends.append(at)
    tables = (
        b"".join(nodes),
        _ends(nodes),
        b"".join(devices),
        _ends(devices),
        sliced.pack_u32([topology.devices[i].fdid for i in by_fdid]),
        sliced.pack_u32(by_fdid),
        sliced.pack_u32([i for g in groups for i in g]),
        sliced.pack_u32(ends),
    )

    def header(spans: tuple[Span, ...]) -> bytes:
        return enc.encode(
            _Header(
                COMPILED_FORMAT,
                digest,
                topology.name,
                topology.source,
                topology.links,
                topology.switch_links,
                tuple(n.name for n in topology.nodes),
                spans,
            )
        )

    head = header_before(_PREFIX, [len(t) for t in tables], header)
    rest = len(head).to_bytes(4, "big") + head + b"".join(tables)
    return zlib.crc32(rest).to_bytes(4, "big") + rest


def _unpack(blob: Readable, digest: str) -> Topology | None:
    size = int.from_bytes(blob.view(4, _PREFIX), "big")
    header = msgspec.msgpack.decode(blob.view(_PREFIX, _PREFIX + size), type=_Header)
    if header.format != COMPILED_FORMAT or header.digest != digest:
        return None
    spans = header.spans
    at = _PREFIX + size
    if len(spans) != len(_TABLES):
        return None
    for start, end in spans:  # in order, one after the other, within the blob
        if start != at or end < start:
            return None
        at = end
    if at != len(blob):
        return None
    t = dict(zip(_TABLES, (Window(blob, s, e) for s, e in spans), strict=True))
    nodes = sliced.NodeTable(header.node_names, t["nodes"], t["node_ends"])
    devices = sliced.DeviceTable(
        nodes,
        t["devices"],
        t["device_ends"],
        t["fdids"],
        t["fdid_pos"],
        t["lender_pos"],
        t["lender_ends"],
    )
    if not sliced.consistent(nodes, devices):
        return None
    return Topology(
        name=header.name,
        # the tables stand in for the tuples: equal to them, decoded on demand
        nodes=cast(tuple[NodeSpec, ...], nodes),
        links=header.links,
        devices=cast(tuple[DeviceSpec, ...], devices),
        source=header.source,
        switch_links=header.switch_links,
    )


def compile_topology(topology: Topology, digest: str) -> bytes | None:
    """The bytes to store next to the text whose digest is ``digest`` and which parses into
    ``topology``; None when the topology would not come back equal (msgpack has no integer
    beyond 64 bits, which TOML sizes can reach): it is then parsed from its text, as before.
    Checked here, once per installed topology, so that no reader ever gets another one."""
    if not _sliceable(topology):
        return None
    try:
        blob = _pack(topology, digest)
    except (OverflowError, msgspec.EncodeError):
        return None
    return blob if decode_compiled(blob, digest) == topology else None


def decode_compiled(blob: bytes | None, digest: str) -> Topology | None:
    """The topology ``blob`` holds, or None when it is missing, of another format, compiled
    from another text, damaged (its CRC), or does not decode into a ``Topology``."""
    if not blob or len(blob) < _PREFIX:
        return None
    if zlib.crc32(memoryview(blob)[4:]) != int.from_bytes(blob[:4], "big"):
        return None
    return decode_compiled_view(Plain(blob), digest)


def decode_compiled_view(blob: Readable, digest: str) -> Topology | None:
    """``decode_compiled`` for bytes that are verified as they are read (``chunked``): the
    CRC, which would read them all, is not checked, and the tables are read when used. A
    chunk that does not match its digest raises its ``VmlendError`` here or at that use."""
    if len(blob) < _PREFIX:
        return None
    try:
        return _unpack(blob, digest)
    except _UNDECODABLE:  # msgspec.ValidationError is a DecodeError; a span out of bounds
        return None


def stored_topology(rec: TopologyRecord) -> Topology:
    """The topology a registry record holds: its compiled form, else its TOML parsed."""
    compiled = rec.compiled
    if compiled is None or isinstance(compiled, bytes):
        topology = decode_compiled(compiled, rec.digest)
    else:  # read from a generation, which verified it (whole or as it is read)
        topology = decode_compiled_view(compiled, rec.digest)
    if topology is None:
        from vmlend.topology.parse import parse_topology  # only without a usable compiled form

        try:
            topology = parse_topology(rec.text, rec.source)
        except TopologyError as e:
            # the text is the state's copy: name the state, not the file it was once read
            # from (the built-in default, say), which may be fine while the copy is damaged
            raise TopologyError(
                f"the state's copy of {rec.source}",
                f"{e.problem}; run 'vmlend fabric init --topology FILE' to install it again",
            ) from None
    return topology
