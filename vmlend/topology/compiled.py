"""The compiled form of a topology: the parsed ``Topology`` as msgpack, stored in the registry
next to the TOML it came from, so that opening a fabric parses no TOML (no ``tomllib``, no
validation: about 7 ms of a CLI command or a hook call).

The TOML stays the source of truth; the compiled form is a cache of it. It is trusted only when
its format tag is this code's and it names the digest of the text stored beside it; anything
else (a record an older vmlend wrote, another format, damage) falls back to parsing the text.

From format 4 the topology is stored *sliced* (``vmlend.topology.sliced``): each node's and
each device's record its own msgpack slice, with indexes by name, fdid and lender, so that a
process decodes only the records it asks for. At 1,024 nodes x 16 devices decoding all of them
took ~0.1 s of every command; a hook call or a reserve needs a handful.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, cast

import msgspec

from vmlend.errors import TopologyError
from vmlend.topology import sliced
from vmlend.topology.model import DeviceSpec, LinkSpec, NodeSpec, Topology

if TYPE_CHECKING:
    from vmlend.registry.records import TopologyRecord

#: Bump when the same bytes would decode into a different ``Topology``: a change to any Struct
#: reachable from it (tests/unit/topology/test_topology_compiled.py pins their shape) or to
#: what the parser derives from the text. A record of another format is simply parsed from its TOML.
COMPILED_FORMAT = "vmlend-topology/6"

#: What a damaged or foreign blob can raise while msgspec decodes it: besides its own errors,
#: a bad byte inside a string (UnicodeDecodeError, a ValueError) and deep nesting.
_UNDECODABLE = (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError)


class _Compiled(msgspec.Struct, frozen=True, array_like=True):
    format: str
    digest: str  # the registry's digest of the TOML text this was compiled from
    check: int  # CRC-32 of the topology bytes: damage that still decodes is not used
    topology: msgspec.Raw  # a _Sliced, decoded only once format, digest and check match


class _Sliced(msgspec.Struct, frozen=True, array_like=True):
    """A ``Topology`` with its nodes and devices as slices (``sliced``); integers in the
    index fields are big-endian u32 (``sliced.pack_u32``)."""

    name: str
    source: str
    links: tuple[LinkSpec, ...]
    switch_links: tuple[tuple[str, str], ...]
    node_names: tuple[str, ...]
    nodes: bytes  # each NodeSpec's msgpack, one after the other
    node_ends: bytes  # where each ends in ``nodes``
    devices: bytes  # each DeviceSpec's msgpack, in declaration order
    device_ends: bytes
    fdids: bytes  # sorted
    fdid_pos: bytes  # for each of ``fdids``: its device's position in ``devices``
    lender_pos: bytes  # device positions grouped by lender, in node order
    lender_ends: bytes  # for each node: where its group ends in ``lender_pos``


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


def _slice(topology: Topology) -> _Sliced:
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
    return _Sliced(
        topology.name,
        topology.source,
        topology.links,
        topology.switch_links,
        tuple(n.name for n in topology.nodes),
        b"".join(nodes),
        _ends(nodes),
        b"".join(devices),
        _ends(devices),
        sliced.pack_u32([topology.devices[i].fdid for i in by_fdid]),
        sliced.pack_u32(by_fdid),
        sliced.pack_u32([i for g in groups for i in g]),
        sliced.pack_u32(ends),
    )


def _unslice(body: _Sliced) -> Topology | None:
    nodes = sliced.NodeTable(body.node_names, body.nodes, body.node_ends)
    devices = sliced.DeviceTable(
        nodes,
        body.devices,
        body.device_ends,
        body.fdids,
        body.fdid_pos,
        body.lender_pos,
        body.lender_ends,
    )
    if not sliced.consistent(nodes, devices):
        return None
    return Topology(
        name=body.name,
        # the tables stand in for the tuples: equal to them, decoded on demand
        nodes=cast(tuple[NodeSpec, ...], nodes),
        links=body.links,
        devices=cast(tuple[DeviceSpec, ...], devices),
        source=body.source,
        switch_links=body.switch_links,
    )


def compile_topology(topology: Topology, digest: str) -> bytes | None:
    """The bytes to store next to the text whose digest is ``digest`` and which parses into
    ``topology``; None when the topology would not come back equal (msgpack has no integer
    beyond 64 bits, which TOML sizes can reach): it is then parsed from its text, as before.
    Checked here, once per installed topology, so that no reader ever gets another one."""
    if not _sliceable(topology):
        return None
    try:
        body = msgspec.msgpack.encode(_slice(topology))
    except (OverflowError, msgspec.EncodeError):
        return None
    envelope = _Compiled(COMPILED_FORMAT, digest, zlib.crc32(body), msgspec.Raw(body))
    blob = msgspec.msgpack.encode(envelope)
    return blob if decode_compiled(blob, digest) == topology else None


def decode_compiled(blob: bytes | None, digest: str) -> Topology | None:
    """The topology ``blob`` holds, or None when it is missing, of another format, compiled
    from another text, or does not decode into a ``Topology``."""
    if not blob:
        return None
    try:
        envelope = msgspec.msgpack.decode(blob, type=_Compiled)
        if envelope.format != COMPILED_FORMAT or envelope.digest != digest:
            return None
        # the Raw is a view into ``blob``: checked and decoded in place, not copied (3.5 MB
        # of fresh memory at 1,024 nodes, in every process)
        body = envelope.topology
        if zlib.crc32(body) != envelope.check:
            return None
        return _unslice(msgspec.msgpack.decode(body, type=_Sliced))
    except _UNDECODABLE:  # msgspec.ValidationError is a DecodeError
        return None


def stored_topology(rec: TopologyRecord) -> Topology:
    """The topology a registry record holds: its compiled form, else its TOML parsed."""
    topology = decode_compiled(rec.compiled, rec.digest)
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
