"""Blobs whose header says where the fields after it lie (pure): the compiled topology
(``vmlend.topology.compiled``) and a stored generation's content
(``vmlend.registry.topopieces``), so that a reader decodes the header and then only the
fields it uses."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

#: Where one field lies in the blob: its first byte and the byte after its last.
Span = tuple[int, int]


def spans_from(start: int, sizes: Iterable[int]) -> tuple[Span, ...]:
    """The spans of fields of ``sizes`` laid one after the other from ``start``."""
    spans, at = [], start
    for size in sizes:
        spans.append((at, at + size))
        at += size
    return tuple(spans)


def header_before(
    prefix: int, sizes: Sequence[int], encode: Callable[[tuple[Span, ...]], bytes]
) -> bytes:
    """The header ``encode(spans)`` of fields of ``sizes`` laid out right after it, the
    header itself after ``prefix`` bytes.

    A fixed point: the spans start where the header ends, so they depend on the header's own
    encoded length, and that length depends on the spans (msgpack writes 127 in one byte and
    128 in two; a decimal 99 is two digits, 100 three). So the header is encoded with the
    fields starting right after ``prefix``, then again with them starting where that header
    ends, until its length stops changing: a second round when an offset crosses such a
    boundary. It ends for an encoding whose length never shrinks as its offsets grow
    (msgpack's, decimal text): each round's offsets are then at least the last round's, and
    the length of a few integers can grow only so far."""
    head = encode(spans_from(prefix, sizes))
    while len(again := encode(spans_from(prefix + len(head), sizes))) != len(head):
        head = again
    return again
