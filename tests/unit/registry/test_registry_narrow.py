"""A reserve compares what it decides on, no more: a hold another VM on the same node gains
meanwhile does not make it re-run, while one the same VM gains does (peer-to-peer admission
counts the VM's own holds). Real etcd; the second reserve is made to land exactly between the
first one's reads and its commit."""

from __future__ import annotations

from tests.support.landing import landing_first
from tests.support.simfabric import make_fabric
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import open_fabric

#: A borrower "b" with one adapter towards each of two lenders (joined for peer-to-peer):
#: reserves of a device of each for two VMs share no adapter, so only what they read about
#: node b's holds could make them conflict.
TWO_LENDERS = """
name = "two-lenders"
[[node]]
name = "l1"
id = 1
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
  [[node.device]]
  fdid = 0x100
  bdf = "0000:01:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1521
  class = 0x020000
  bars = [ { index = 0, size = "16MiB" } ]
[[node]]
name = "l2"
id = 2
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
  [[node.device]]
  fdid = 0x200
  bdf = "0000:01:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1521
  class = 0x020000
  bars = [ { index = 0, size = "16MiB" } ]
[[node]]
name = "b"
id = 3
  [[node.adapter]]
  index = 0
  [[node.adapter]]
  index = 1
[[link]]
ends = ["l1:0", "b:0"]
[[link]]
ends = ["l2:0", "b:1"]
[[link]]
ends = ["l1:1", "l2:1"]
"""

VM1 = Holder("b", "vm1", "11111111-0000-4000-8000-000000000001")
VM2 = Holder("b", "vm2", "11111111-0000-4000-8000-000000000002")


def _reserve_with_another_landing_first(url: str, first: Holder, second: Holder) -> int:
    """Reserve 0x100 for ``first`` while, just before its commit, another reserve of the
    host's process (which decides the node's own places: it took b over before) reserves
    0x200 for ``second``; how often the first one's body had to run again."""
    make_fabric(url, TWO_LENDERS, node="b").close()
    mine, other = open_fabric(url, "b"), open_fabric(url, "b")
    warm = Holder("b", "warm")
    mine.reserve(0x200, warm)
    mine.release(0x200, warm)
    landing_first(mine, lambda: other.reserve(0x200, second))
    try:
        assert mine.reserve(0x100, first).created
        assert other.device(0x200).holder == second and other.device(0x100).holder == first
        return mine.registry.conflicts + mine.registry.stale  # from fresh reads, or memory
    finally:
        mine.close()
        other.close()


def test_another_vms_new_hold_on_the_node_does_not_conflict(etcd_url):
    assert _reserve_with_another_landing_first(etcd_url, VM1, VM2) == 0


def test_the_same_vms_new_hold_does_conflict(etcd_url):
    assert _reserve_with_another_landing_first(etcd_url, VM1, VM1) == 1
