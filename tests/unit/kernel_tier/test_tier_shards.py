"""tests/support/tier_shards.py: the guests `make test-kernel` boots side by side split the
tier's tests between them, every test in exactly one guest, the long ones apart."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.tier_shards import parse_shard, shard_of, weight

TIER = [
    "tests/kernel/test_discover_kernel.py::test_a",
    "tests/kernel/test_takeback_kernel.py::test_a_fenced_device_is_taken_back_by_the_lenders_agent",
    "tests/kernel/test_vm_kernel.py::test_the_agent_serves_libvirtds_hook[etcd]",
    "tests/kernel/test_vm_kernel.py::test_the_agent_serves_libvirtds_hook[sqlite]",
    "tests/kernel/test_vm_kernel.py::test_e",
    "tests/kernel/test_mdev_kernel.py::test_f",
]


@given(
    st.lists(
        st.sampled_from(["a", "b", "x::test_a_fenced_device_is_taken_back_by_the_lenders_agent"]),
        max_size=40,
    ),
    st.integers(1, 4),
)
def test_every_test_runs_in_exactly_one_shard_in_collection_order(kinds, n):
    ids = [f"tests/kernel/test_{kind}{i}" for i, kind in enumerate(kinds)]
    shards = [shard_of(ids, k, n) for k in range(1, n + 1)]
    assert sorted(i for s in shards for i in s) == sorted(ids)
    for s in shards:
        assert s == [i for i in ids if i in s]


def test_the_long_tests_are_dealt_apart_and_the_loads_end_close():
    one, two = shard_of(TIER, 1, 2), shard_of(TIER, 2, 2)
    loads = [sum(weight(i) for i in s) for s in (one, two)]
    assert TIER[1] in one and not any("takeback" in i for i in two)
    assert TIER[2] in two  # the next longest, beside the longest
    assert abs(loads[0] - loads[1]) <= max(weight(i) for i in TIER)


def test_one_shard_of_one_is_the_whole_tier():
    assert shard_of(TIER, 1, 1) == TIER


@pytest.mark.parametrize("text", ["", "1", "0/2", "3/2", "a/b", "1/0", "-1/2"])
def test_a_malformed_shard_is_refused(text):
    with pytest.raises(ValueError):
        parse_shard(text)


def test_a_shard_parses():
    assert parse_shard("2/3") == (2, 3)


def test_every_long_test_the_table_names_is_a_test_of_the_tier():
    """A renamed test would silently count as light: the table must follow renames."""
    from tests.support.paths import REPO
    from tests.support.tier_shards import HEAVY

    source = "".join(p.read_text() for p in (REPO / "tests" / "kernel").glob("test_*.py"))
    missing = [key for key in HEAVY if key.split("[")[0] not in source]
    assert missing == []
