"""Byte sizes as people read them (``vmlend.units``): exact sizes in the largest unit that
divides them, human ones in the largest unit not above them."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize(
    ("size", "human", "exact"),
    [
        (1 << 10, "1 KiB", "1K"),
        (1 << 20, "1 MiB", "1M"),
        (1 << 30, "1 GiB", "1G"),
        (1 << 40, "1 TiB", "1T"),
    ],
)
def test_exact_powers_of_1024_print_in_the_larger_unit(size, human, exact):
    assert format_size_human(size) == human  # not "1024 MiB"
    assert format_size_exact(size) == exact
