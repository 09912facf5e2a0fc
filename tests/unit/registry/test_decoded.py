"""``Decoded``: a stored form is decoded once while kept; past the limit all are forgotten."""

from __future__ import annotations

import pytest

from vmlend.registry.decoded import Decoded


def test_each_stored_form_is_decoded_once_and_an_equal_form_is_the_same_record():
    calls: list[bytes] = []

    def decode(raw: bytes) -> str:
        calls.append(raw)
        return raw.decode().upper()

    seen: Decoded[bytes, str] = Decoded()
    assert [seen(b"a", decode), seen(b"b", decode), seen(b"a", decode)] == ["A", "B", "A"]
    assert calls == [b"a", b"b"]


def test_past_the_limit_what_was_kept_is_decoded_again():
    calls: list[int] = []

    def decode(n: int) -> int:
        calls.append(n)
        return -n

    seen: Decoded[int, int] = Decoded(limit=2)
    for n in (1, 2, 3, 1):
        assert seen(n, decode) == -n
    assert calls == [1, 2, 3, 1]  # the third form forgot the first two


def test_a_form_that_does_not_decode_is_not_kept():
    seen: Decoded[str, int] = Decoded()
    with pytest.raises(ValueError):
        seen("x", int)
    assert seen("7", int) == 7
    with pytest.raises(ValueError):
        seen("x", int)  # raised again, not answered from anything kept
