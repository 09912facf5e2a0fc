"""NTB adapters: window segments, translation, the requester LUT."""

from __future__ import annotations

import pytest

from vmlend.errors import DmaFault, FabricError, NoPathError, ResourceExhaustedError
from vmlend.sim.ntb import NtbAdapter
from vmlend.topology.model import AdapterSpec, GiB

BASE = 0x100_0000_0000


@pytest.fixture
def ntb() -> NtbAdapter:
    spec = AdapterSpec(node="alpha", index=0, window_size=128 * GiB, segments=32, cpus=1)
    return NtbAdapter(spec, BASE, peers={"beta", "gamma"})


def test_window_geometry(ntb):
    assert ntb.segment_size == 4 * GiB
    assert ntb.contains(BASE) and ntb.contains(BASE + 128 * GiB - 1)
    assert not ntb.contains(BASE + 128 * GiB) and not ntb.contains(BASE - 1)
    assert ntb.segment_of(BASE + 9 * GiB) == 2
    assert ntb.segment_base(31) == BASE + 124 * GiB


def test_segment_translation(ntb):
    ntb.map_segment(3, "gamma", 0x2_0000_0000)
    assert ntb.translate(BASE + 3 * 4 * GiB + 0x1234) == ("gamma", 0x2_0000_1234)
    assert ntb.segment(3).remote_node == "gamma"
    with pytest.raises(DmaFault) as e:
        ntb.translate(BASE + 4 * 4 * GiB)
    assert e.value.hop == "ntb-segment"
    assert ntb.unmap_segment(3) and not ntb.unmap_segment(3)
    with pytest.raises(DmaFault):
        ntb.translate(BASE + 3 * 4 * GiB)


def test_segment_mapping_rules(ntb):
    ntb.map_segment(0, "gamma", 0)
    ntb.map_segment(0, "gamma", 0)  # same again is fine
    with pytest.raises(FabricError, match="unmap it first"):
        ntb.map_segment(0, "beta", 0)
    with pytest.raises(NoPathError):
        ntb.map_segment(1, "delta", 0)
    with pytest.raises(FabricError, match="itself"):
        ntb.map_segment(1, "alpha", 0)
    with pytest.raises(FabricError, match="aligned"):
        ntb.map_segment(1, "gamma", 0x800)
    with pytest.raises(ValueError):
        ntb.map_segment(32, "gamma", 0)


def test_free_segments_finds_consecutive_runs(ntb):
    ntb.map_segment(1, "gamma", 0)
    assert ntb.free_segments(1) == 0
    assert ntb.free_segments(2) == 2
    for i in range(2, 32):
        ntb.map_segment(i, "gamma", i * 4 * GiB)
    with pytest.raises(ResourceExhaustedError, match="segments"):
        ntb.free_segments(2)


def test_lut_reserves_entries_for_cpus(ntb):
    assert ntb.lut_usable == 30
    first = ntb.lut_add(0x4100)
    assert first == 2  # entries 0 and 1 belong to the CPU
    assert ntb.lut_add(0x4100) == first  # idempotent
    assert ntb.lut_lookup(0x4100) == first and ntb.lut_lookup(0x4200) is None


def test_lut_exhaustion(ntb):
    for dev in range(30):  # 30 devices (bus 0x10, device numbers 0..29)
        ntb.lut_add(0x1000 + (dev << 3))
    assert ntb.lut_free == 0
    with pytest.raises(ResourceExhaustedError) as e:
        ntb.lut_add(0x2000)
    assert e.value.have == 30 and e.value.need == 31
    assert "alpha:0" in str(e.value)
    ntb.lut_add(0x1001)  # function 1 of a device that has its entry: no entry more
    ntb.lut_remove(0x1000 + (5 << 3))
    assert ntb.lut_add(0x2000) == 7  # the freed entry is reused


def test_functions_of_one_device_share_an_entry_until_the_last_goes(ntb):
    pf = ntb.lut_add(0x4100)  # 41:00.0
    assert ntb.lut_add(0x4107) == pf  # 41:00.7: the same device
    assert ntb.lut_add(0x4108) != pf  # 41:01.0 (ARI function 8): device 1, an entry of its own
    assert ntb.lut_used == 2
    assert ntb.lut() == {0x4100: pf, 0x4107: pf, 0x4108: pf + 1}
    assert ntb.lut_lookup(0x4101) is None  # a function nobody let across is still dropped
    assert ntb.lut_remove(0x4100) and ntb.lut_lookup(0x4107) == pf and ntb.lut_used == 2
    assert ntb.lut_remove(0x4107) and ntb.lut_used == 1
    assert not ntb.lut_remove(0x4107)


def test_an_entering_function_keeps_its_function_number(ntb):
    # entry 2 on bus 0xf0 is device 2 there; functions 0 and 5 of the remote device stay apart
    assert ntb.assigned_requester_id(2, 0x4100) == 0xF010
    assert ntb.assigned_requester_id(2, 0x4105) == 0xF015


def test_a_reset_keeps_the_functions_of_an_entry_for_its_restore(ntb):
    entry = ntb.lut_add(0x4100)
    ntb.lut_add(0x4101)
    ntb.reset()
    assert ntb.lut() == {} and ntb.lut_used == 0
    ntb.lut_remove(0x4101)
    assert ntb.restore() == 1
    assert ntb.lut() == {0x4100: entry}


def test_lut_with_more_cpus_has_fewer_entries():
    spec = AdapterSpec(node="a", index=1, window_size=GiB, segments=4, cpus=4)
    ntb = NtbAdapter(spec, 0, peers={"b"})
    assert ntb.lut_usable == 24
    assert ntb.lut_add(1) == 8
    assert ntb.bus == 0xF1


def test_window_must_be_aligned():
    spec = AdapterSpec(node="a", index=0, window_size=GiB, segments=4)
    with pytest.raises(ValueError):
        NtbAdapter(spec, 0x1000)
