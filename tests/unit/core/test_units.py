"""Byte sizes as people read them (``vmlend.units``): exact sizes in the largest unit that
divides them, human ones in the largest unit not above them."""

from __future__ import annotations

from vmlend.units import format_size_exact, format_size_human


def test_format_size():
    assert [format_size_exact(n) for n in (4 << 30, 512 << 20, 3 << 10, 1000)] == [
        "4G",
        "512M",
        "3K",
        "1000B",
    ]


def test_format_size_human():
    # Messages about amounts that need not be round: two decimals at most.
    assert [format_size_human(n) for n in (64 << 30, (32 << 30) + (50 << 20), 16 << 20, 512)] == [
        "64 GiB",
        "32.05 GiB",
        "16 MiB",
        "512 bytes",
    ]
