"""``vmlend reconcile`` and a running VM's queue-level NVMe share: the drive is held by its
manager, so the VM's share (not a hold) justifies its controller. Before, every VM with a
share off the lender was reported as using a drive another VM holds."""

from __future__ import annotations

import json
import uuid

from tests.support.cli_cluster import GAMMA
from tests.support.share_moves import NVME, share_drive, start_sharing
from vmlend.ledger import nvmeshares
from vmlend.topology.model import Holder


def drift(cluster) -> list[dict]:  # type: ignore[no-untyped-def]
    r = cluster.cli("reconcile", *GAMMA, "--json")
    found = json.loads(r.stdout)["drift"]
    assert r.exit_code == (1 if found else 0), r.output
    return found


def test_a_vm_with_its_share_is_no_drift_and_one_without_is_not_fixed(cluster):
    share_drive(cluster)
    start_sharing(cluster, "gamma", "vm1")
    assert drift(cluster) == []
    holder = Holder("gamma", "vm1", str(uuid.uuid5(uuid.NAMESPACE_DNS, "vm1")))
    with cluster.fabric() as f:
        assert nvmeshares.release_share(f.registry, NVME, holder)
    (found,) = drift(cluster)
    assert found["kind"] == "missing-hold" and found["vm"] == "vm1"
    assert found["fixable"] is False and "a new share would not hold" in found["fix"]
    cluster.cli("reconcile", *GAMMA, "--fix")
    with cluster.fabric() as f, f.registry.read() as tx:
        assert tx.runtime(NVME, nvmeshares.SHARE_RECORD) == []  # no new share was made
