"""Set-ups for the live-migration tests of VMs with a queue-level NVMe share, on the CLI's
simulated nodes: a shared drive, VMs each with a share controller at a known guest address,
and reads of the registry's share records and mdevs. No tests here."""

from __future__ import annotations

import uuid

from tests.support.cli_cluster import TEMPLATES, SimCluster, make_cluster
from vmlend.domain import (
    DeviceRequest,
    DomainSpec,
    NvmeShareRequest,
    PciAddress,
    new_domain,
    read_domain,
)
from vmlend.ledger.nvmeshares import SHARE_RECORD
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.topology.model import MiB
from vmlend.wiring.fabric import default_topology_text

GPU, NVME = 0x10, 0x12
SHARE_AT = "0000:00:0b.0"  # the guest address of each VM's share controller


def start_sharing(
    cluster: SimCluster, node: str, name: str, *, gpu: bool = False, paths: int = 1
) -> None:
    """Define and start ``name`` on ``node`` with a share of the NVMe drive (and the GPU)."""
    spec = DomainSpec(
        name=name,
        memory_bytes=512 * MiB,
        virt_type="qemu",
        uuid=uuid.uuid5(uuid.NAMESPACE_DNS, name),
        devices=[
            DeviceRequest(
                NVME, PciAddress.parse(SHARE_AT), share=NvmeShareRequest(1, 32 * MiB, paths)
            ),
            *([DeviceRequest(GPU)] if gpu else []),
        ],
    )
    hv = cluster.hv(node)
    hv.define(new_domain(spec, templates=TEMPLATES).to_bytes())
    hv.start(name)


def share_drive(cluster: SimCluster) -> None:
    r = cluster.cli("nvme", "share", hex(NVME), "--size", "2G")
    assert r.exit_code == 0, r.output


def shares(cluster: SimCluster) -> dict[str, dict]:
    """The drive's share records, by key ("vm:node/vm")."""
    with cluster.fabric() as f, f.registry.read() as tx:
        return {r.key: r.data for r in tx.runtime(NVME, SHARE_RECORD)}


def share_mdevs(cluster: SimCluster) -> set[tuple[str, str]]:
    with cluster.fabric() as f, f.registry.read() as tx:
        return {(m.node, m.vm) for m in tx.mdevs() if m.type_id == SHARE_MDEV_TYPE}


def share_address(cluster: SimCluster, node: str, vm: str = "vm1") -> str | None:
    """Where ``vm``'s live XML on ``node`` has its share controller (None: not plugged)."""
    dom = read_domain(cluster.hv(node).xml(vm))
    return next((str(d.address) for d in dom.devices if d.share is not None), None)


def two_adapter_cluster(state_path) -> SimCluster:  # type: ignore[no-untyped-def]
    """The CLI's simulated nodes on ``two_adapter_topology``."""
    return make_cluster(state_path, two_adapter_topology())


def two_adapter_topology() -> str:
    """The default cluster with a second NTB adapter in beta, on gamma's second switch: a
    share of two paths fits on beta as on gamma."""
    text, _source = default_topology_text()
    adapter = (
        '  [[node.adapter]]\n  index = 1\n  model = "PXH830"\n  window = "128GiB"\n'
        '  segments = 32\n  lut_entries = 32\n  cpus = 1\n  slot = "rp1"\n\n'
    )
    beta = text.index('name = "beta"')
    at = text.index("  [[node.device]]", beta)
    text = text[:at] + adapter + text[at:]
    return text.replace('ports = ["gamma:1"]', 'ports = ["gamma:1", "beta:1"]')
