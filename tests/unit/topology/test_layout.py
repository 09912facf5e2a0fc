"""A header that says where the fields after it lie: its offsets count its own length, so
they must be where the fields really are, whatever that length does to them."""

from __future__ import annotations

import msgspec
import pytest

from vmlend.topology.layout import Span, header_before, spans_from


def test_spans_lie_one_after_the_other():
    assert spans_from(8, [3, 0, 5]) == ((8, 11), (11, 11), (11, 16))
    assert spans_from(4, []) == ()


def _decimal(spans: tuple[Span, ...]) -> bytes:
    """A header of 95 bytes of padding and the first field's offset in decimal."""
    return b"x" * 95 + str(spans[0][0]).encode()


def test_a_header_whose_offset_crosses_a_digit_boundary_is_encoded_again():
    # laid out from the prefix alone the offset is 4, one digit: 96 bytes, so the field starts
    # at 100, three digits: 98 bytes, so it starts at 102 (three digits still: done)
    assert len(_decimal(spans_from(4, [10]))) == 96
    head = header_before(4, [10], _decimal)
    assert head == b"x" * 95 + b"102"
    assert int(head[95:]) == 4 + len(head)  # the field starts right after the header


@pytest.mark.parametrize("pad", [0, 118, 119, 120, 121, 250, 65_530])
def test_a_msgpack_header_points_at_its_fields_whatever_its_length(pad):
    # msgpack writes an offset up to 127 in one byte, up to 255 in two, up to 65,535 in three
    sizes = [7, 0, 300, 65_536]

    def encode(spans: tuple[Span, ...]) -> bytes:
        return msgspec.msgpack.encode(("p" * pad, spans))

    head = header_before(8, sizes, encode)
    _pad, spans = msgspec.msgpack.decode(head, type=tuple[str, tuple[Span, ...]])
    assert spans == spans_from(8 + len(head), sizes)
    assert spans[-1][1] == 8 + len(head) + sum(sizes)


def test_a_header_of_a_steady_length_is_encoded_as_it_first_was():
    def encode(spans: tuple[Span, ...]) -> bytes:
        return b"%08d" % spans[0][0]

    assert header_before(4, [1], encode) == b"00000012"
