"""The compiled form of a topology: the parsed ``Topology`` as msgpack, stored in the registry
next to the TOML it came from, so that opening a fabric parses no TOML (no ``tomllib``, no
validation: about 7 ms of a CLI command or a hook call).

The TOML stays the source of truth; the compiled form is a cache of it. It is trusted only when
its format tag is this code's and it names the digest of the text stored beside it; anything
else (a record an older vmlend wrote, another format, damage) falls back to parsing the text.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import msgspec

from vmlend.errors import TopologyError
from vmlend.topology.model import Topology

if TYPE_CHECKING:
    from vmlend.registry.records import TopologyRecord

#: Bump when the same bytes would decode into a different ``Topology``: a change to any Struct
#: reachable from it (tests/unit/topology/test_topology_compiled.py pins their shape) or to
#: what the parser derives from the text. A record of another format is simply parsed from its TOML.
COMPILED_FORMAT = "vmlend-topology/4"

#: What a damaged or foreign blob can raise while msgspec decodes it: besides its own errors,
#: a bad byte inside a string (UnicodeDecodeError, a ValueError) and deep nesting.
_UNDECODABLE = (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError)


class _Compiled(msgspec.Struct, frozen=True, array_like=True):
    format: str
    digest: str  # the registry's digest of the TOML text this was compiled from
    check: int  # CRC-32 of the topology bytes: damage that still decodes is not used
    topology: msgspec.Raw  # decoded as a Topology only once format, digest and check match


def compile_topology(topology: Topology, digest: str) -> bytes | None:
    """The bytes to store next to the text whose digest is ``digest`` and which parses into
    ``topology``; None when the topology would not come back equal (msgpack has no integer
    beyond 64 bits, which TOML sizes can reach): it is then parsed from its text, as before.
    Checked here, once per installed topology, so that no reader ever gets another one."""
    try:
        body = msgspec.msgpack.encode(topology)
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
        body = bytes(envelope.topology)
        if zlib.crc32(body) != envelope.check:
            return None
        return msgspec.msgpack.decode(body, type=Topology)
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
