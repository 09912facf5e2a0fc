"""A hot move's hand-over (``vmlend.ledger.handover``) on etcd, whose transactions take at most
128 operations (``--max-txn-ops``). The hand-over re-makes every hold of the VM, with the
source's claims and the destination's, in one transaction: a VM of three devices across two
lenders joined by a cable of their own (the etcd state machine's cluster) went over (176
operations: each claim key deleted and put again under another key, each unit block given
back and another taken) and could never move. Now (layout 5) a hold's claims are in its VM's
ledger and on its unit blocks, and the holds are all dropped before any is re-made, so the
destination's take back the unit blocks the source's gave (a put over a delete: one
operation)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.support.simfabric import make_fabric
from vmlend.ledger import handover
from vmlend.registry import ClaimKind, Registry
from vmlend.topology.model import GiB, Holder

_ADAPTER = """
  [[node.adapter]]
  index = {index}
  model = "PXH830"
  window = "64GiB"
  segments = 32
  lut_entries = 32
  cpus = 1
"""
_GPU = """
  kind = "gpu"
  vendor = 0x10de
  device = 0x1db4
  class = 0x030200
  dma_bits = 40
  bars = [ { index = 0, size = "16MiB", kind = "mem32" },
           { index = 1, size = "1GiB", kind = "mem64", prefetch = true } ]
  msi = { vectors = 1, bits64 = true }
"""
#: The state machine's lenders: alpha (a GPU, an NVMe drive) and beta (a GPU) on the switch
#: and joined by their own cable, the cheapest route between them, so peer-to-peer between
#: them leaves by other adapters than their devices' crossings to the VM's node.
TOPOLOGY = f"""
name = "two-lenders-cabled"
[[node]]
name = "alpha"
id = 4
ram = "64GiB"
{_ADAPTER.format(index=0)}
{_ADAPTER.format(index=1)}
  [[node.device]]
  fdid = 0x10
  bdf = "0000:41:00.0"
{_GPU}
  [[node.device]]
  fdid = 0x12
  bdf = "0000:43:00.0"
  kind = "nvme"
  vendor = 0x144d
  device = 0xa80a
  class = 0x010802
  bars = [ {{ index = 0, size = "64KiB", kind = "mem64" }},
           {{ index = 4, size = "16KiB", kind = "mem64" }} ]
  msix = {{ vectors = 64, table_bar = 4, table_offset = 0, pba_bar = 4, pba_offset = 0x2000 }}

[[node]]
name = "beta"
id = 8
ram = "64GiB"
{_ADAPTER.format(index=0)}
{_ADAPTER.format(index=1)}
  [[node.device]]
  fdid = 0x20
  bdf = "0000:41:00.0"
{_GPU}

[[node]]
name = "gamma"
id = 12
ram = "64GiB"
{_ADAPTER.format(index=0)}

[[node]]
name = "delta"
id = 16
ram = "64GiB"
{_ADAPTER.format(index=0)}

[[switch]]
name = "sw"
ports = ["alpha:0", "beta:0", "gamma:0", "delta:0"]

[[link]]
ends = ["alpha:1", "beta:1"]
"""
DEVICES = [0x10, 0x12, 0x20]
SOURCE = Holder("gamma", "a", "aaaaaaaa-0000-0000-0000-000000000001")
DEST = Holder("delta", "a", SOURCE.vm_uuid)


def claims_of(registry: Registry) -> dict[int, Counter[object]]:
    with registry.read() as tx:
        out: dict[int, Counter[object]] = {}
        for f, c in tx.claims():
            out.setdefault(f, Counter())[c] += 1
        return out


def holders(registry: Registry) -> dict[int, tuple[str, str]]:
    with registry.read() as tx:
        return {f: (h.holder.node, h.holder.vm) for f, h in tx.holds().items()}


@pytest.fixture
def reserved(etcd_url: str):
    fabric = make_fabric(etcd_url, TOPOLOGY, "gamma")
    for f in DEVICES:
        fabric.reserve(f, SOURCE, guest_ram=GiB)
    with fabric.registry.read() as tx:  # peer-to-peer between the lenders, over their cable
        p2p = [c.adapter for f, c in tx.claims() if c.kind is ClaimKind.P2P]
    assert {"alpha:1", "beta:1"} <= set(p2p)
    yield fabric
    fabric.close()


def test_a_vm_of_three_devices_across_cabled_lenders_is_handed_over_on_etcd(reserved):
    registry = reserved.registry
    before = claims_of(registry)
    claimed = handover.claim_destination(registry, DEVICES, SOURCE, DEST, GiB)
    both = claims_of(registry)
    tokens = handover.hand_over(registry, claimed, {}, 1.0)
    assert holders(registry) == {f: ("delta", "a") for f in DEVICES}
    assert claims_of(registry) == both  # every claim kept, the source's and the destination's
    assert set(tokens) == set(DEVICES)
    handover.release_source(registry, claimed)
    assert claims_of(registry) == {f: Counter(claimed.claims[f]) for f in DEVICES}
    # and back: the same shape again, now from delta
    back = handover.claim_destination(registry, DEVICES, DEST, SOURCE, GiB)
    handover.hand_over(registry, back, {}, 2.0)
    handover.release_source(registry, back)
    assert holders(registry) == {f: ("gamma", "a") for f in DEVICES}
    assert claims_of(registry) == before


def test_its_hand_over_rolled_back_on_etcd_gives_the_source_its_claims_again(reserved):
    registry = reserved.registry
    before = claims_of(registry)
    claimed = handover.claim_destination(registry, DEVICES, SOURCE, DEST, GiB)
    handover.hand_over(registry, claimed, {}, 1.0)
    handover.hand_back(registry, claimed, {}, 2.0)
    assert holders(registry) == {f: ("gamma", "a") for f in DEVICES}
    assert claims_of(registry) == before
