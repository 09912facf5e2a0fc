"""A topology decoded per node and per device, on demand (pure: no I/O).

At 1,024 nodes x 16 devices, decoding the whole compiled topology (every node, adapter and
device record) took ~0.1 s of every CLI command and hook call, while a reserve or a hook's
prepare touches a few nodes and devices. So the compiled form (``vmlend.topology.compiled``)
keeps each node's and each device's record as its own msgpack slice, with indexes:

- the node names, in order (a name finds its slice);
- the fdids, sorted, each with its device's position in declaration order;
- per node, the positions of the devices it lends.

``NodeTable`` and ``DeviceTable`` stand in for ``Topology.nodes`` and ``Topology.devices``:
sequences equal to the tuples they replace, decoding a record when it is first asked for, and
everything at once only when iterated whole. They read their bytes through a ``Readable``
(``vmlend.topology.chunked``): checked before (``compiled.decode_compiled``: the blob's CRC),
or chunk by chunk as they are read (a generation's chunks, against the digests its head names),
so a lookup reads and verifies the few kilobytes it decodes, whatever the fabric's size.
"""

from __future__ import annotations

import bisect
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar, overload

import msgspec

from vmlend.topology.chunked import Readable, whole
from vmlend.topology.model import DeviceSpec, NodeSpec, SpecTable

_S = TypeVar("_S", NodeSpec, DeviceSpec)
_K = TypeVar("_K", str, int)

_ARRAY32 = b"\xdd"  # msgpack array 32 header: decodes every slice in one call


def pack_u32(values: Sequence[int]) -> bytes:
    """``values`` as big-endian unsigned 32-bit integers (the blob crosses hosts)."""
    return b"".join(v.to_bytes(4, "big") for v in values)


def unpack_u32(data: bytes) -> array[int]:
    """``pack_u32``'s inverse, as a native array (one copy, no per-item work)."""
    code = "I" if array("I").itemsize == 4 else "L"
    out = array(code)
    out.frombytes(data[: len(data) - len(data) % 4])
    if sys.byteorder == "little":
        out.byteswap()
    return out


class U32:
    """A packed array of big-endian u32 (``pack_u32``) read a value at a time through its
    ``Readable``: a lookup in 16,384 fdids reads (and verifies) the few chunks its bisection
    touches, not the 64 KB of the whole array."""

    def __init__(self, data: Readable) -> None:
        self._data = data
        self._len = len(data) // 4

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self._len:
            raise IndexError("u32 index out of range")
        return int.from_bytes(self._data.view(4 * i, 4 * i + 4), "big")

    def span(self, start: int, end: int) -> array[int]:
        """Values ``start`` to ``end``, in one read."""
        return unpack_u32(bytes(self._data.view(4 * start, 4 * end)))


class _Slices(Generic[_S]):
    """Records of one type, each its own msgpack slice of ``blob`` ending at ``ends[i]``."""

    def __init__(self, kind: type[_S], blob: Readable, ends: Readable) -> None:
        self._decoder: msgspec.msgpack.Decoder[_S] = msgspec.msgpack.Decoder(kind)
        self._all_decoder = msgspec.msgpack.Decoder(tuple[kind, ...])  # type: ignore[valid-type]
        self._blob = blob
        self._ends = U32(ends)
        self._one: dict[int, _S] = {}
        self._every: tuple[_S, ...] | None = None

    def __len__(self) -> int:
        return len(self._ends)

    def at(self, i: int) -> _S:
        if self._every is not None:
            return self._every[i]
        found = self._one.get(i)
        if found is None:
            bounds = self._ends.span(i - 1, i + 1) if i else (0, self._ends[0])
            found = self._one[i] = self._decoder.decode(self._blob.view(bounds[0], bounds[1]))
        return found

    def every(self) -> tuple[_S, ...]:
        if self._every is None:
            header = _ARRAY32 + len(self._ends).to_bytes(4, "big")
            self._every = self._all_decoder.decode(header + bytes(whole(self._blob)))
        return self._every


class _Table(SpecTable[_K, _S]):
    """A sequence of records equal to the tuple it stands for (``Topology`` compares its
    fields with ``==``), decoded lazily."""

    _slices: _Slices[_S]

    def __len__(self) -> int:
        return len(self._slices)

    @overload
    def __getitem__(self, i: int) -> _S: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[_S, ...]: ...
    def __getitem__(self, i: int | slice) -> _S | tuple[_S, ...]:
        if isinstance(i, slice):
            return self._slices.every()[i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("topology table index out of range")
        return self._slices.at(i % n)

    def __iter__(self) -> Iterator[_S]:
        return iter(self._slices.every())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Table):
            other = other._slices.every()
        if not isinstance(other, tuple):
            return NotImplemented
        return self._slices.every() == other

    def __hash__(self) -> int:
        return hash(self._slices.every())

    def __repr__(self) -> str:
        return repr(self._slices.every())


class NodeTable(_Table[str, NodeSpec]):
    """``Topology.nodes``, decoded per node: ``get(name)`` decodes that node alone."""

    def __init__(self, names: tuple[str, ...], blob: Readable, ends: Readable) -> None:
        self._slices = _Slices(NodeSpec, blob, ends)
        self.names = names
        self._position: dict[str, int] | None = None

    def position(self, name: str) -> int | None:
        if self._position is None:
            # names are distinct (``compiled`` does not slice a topology where they are not)
            self._position = {n: i for i, n in enumerate(self.names)}
        return self._position.get(name)

    def get(self, key: str) -> NodeSpec | None:
        i = self.position(key)
        return None if i is None else self._slices.at(i)


class DeviceTable(_Table[int, DeviceSpec]):
    """``Topology.devices``, decoded per device: ``get(fdid)`` finds it by bisection in the
    sorted fdids, ``of_lender(node)`` decodes that node's devices alone."""

    def __init__(  # the tables of one compiled form
        self,
        nodes: NodeTable,
        blob: Readable,
        ends: Readable,
        fdids: Readable,
        fdid_pos: Readable,
        lender_pos: Readable,
        lender_ends: Readable,
    ) -> None:
        self._slices = _Slices(DeviceSpec, blob, ends)
        self._nodes = nodes
        self._fdids = U32(fdids)
        self._fdid_pos = U32(fdid_pos)
        self._lender_pos = U32(lender_pos)
        self._lender_ends = U32(lender_ends)
        self._by_fdid: dict[int, int | None] = {}

    def get(self, key: int) -> DeviceSpec | None:
        found = self._by_fdid.get(key, -1)
        if found == -1:
            # a bisection reads ~14 u32s at 16,384 devices; a reserve asks for its device
            # many times, so each answer is kept (as the record it finds is)
            i = bisect.bisect_left(self._fdids, key)
            found = None
            if i < len(self._fdids) and self._fdids[i] == key:
                found = self._fdid_pos[i]
            self._by_fdid[key] = found
        return None if found is None else self._slices.at(found)

    def of_lender(self, node: str) -> list[DeviceSpec]:
        n = self._nodes.position(node)
        if n is None:
            return []
        bounds = self._lender_ends.span(n - 1, n + 1) if n else (0, self._lender_ends[0])
        return [self._slices.at(p) for p in self._lender_pos.span(bounds[0], bounds[1])]


def consistent(nodes: NodeTable, devices: DeviceTable) -> bool:
    """Whether the index arrays agree in length with what they index (a check on bytes whose
    CRC matched, so it guards against a compiler bug, not damage)."""
    d = devices
    return (
        len(nodes.names) == len(nodes)
        and len(d._fdids) == len(d._fdid_pos) == len(d._lender_pos) == len(d)
        and len(d._lender_ends) == len(nodes)
    )
