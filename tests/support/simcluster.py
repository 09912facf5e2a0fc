"""One simulated cluster for tests (``Cluster``): one SimHardware, a SimFabric per borrower
node driving it, the registry they share (a state file, or an etcd cluster's URL), and the
hook's prepare/release; the domain XML of a plain VM with remote devices (``domain_xml``);
and the invariant checker's verdict on a cluster as an assertion (``assert_matches_registry``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.simfabric import make_fabric
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain, read_domain
from vmlend.hook.actionlog import NullLog
from vmlend.hook.ops import HookOps
from vmlend.memory.dmarecords import DMA_WINDOW
from vmlend.registry import Registry, open_registry
from vmlend.sim.backend import SimFabric
from vmlend.sim.dmawin import RegistryWindowLedger
from vmlend.sim.hardware import SimHardware
from vmlend.sim.hostmem import HUGE_2M
from vmlend.sim.invariants import check_with_registry
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import MiB

TEMPLATES = TemplateSet()


def domain_xml(name: str, memory: int, machine: str = "q35", fdids=(0x12,)) -> bytes:
    spec = DomainSpec(
        name=name,
        memory_bytes=memory,
        machine=machine,
        uuid=uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.vmlend.test"),
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TEMPLATES).to_bytes()


@dataclass
class Cluster:
    """The default cluster: one hardware, one SimFabric per borrower node, one registry (an
    etcd registry's writes use the agent lease published under ``$VMLEND_ROOT``)."""

    path: Path | str
    hw: SimHardware
    registry: Registry
    fabrics: dict[str, SimFabric] = field(default_factory=dict)

    @classmethod
    def create(cls, path: Path | str, text: str | None = None, node: str = "gamma") -> Cluster:
        base = make_fabric(path, text, node)
        hw = SimHardware.from_topology(base.topology(), seed=1)
        base.close()
        return cls(path, hw, open_registry(path))

    def fabric(self, node: str = "gamma") -> SimFabric:
        if node not in self.fabrics:
            registry = open_registry(self.path)
            self.fabrics[node] = SimFabric(registry, node, hardware=self.hw)
        return self.fabrics[node]

    def prepare(self, xml: bytes, node: str = "gamma") -> None:
        """What the hook's prepare does: reserve every device and create its mdev."""
        HookOps(self.fabric(node), NullLog()).prepare(read_domain(xml))

    def release(self, xml: bytes, node: str = "gamma") -> None:
        HookOps(self.fabric(node), NullLog()).release(read_domain(xml))

    def start(self, xml: bytes, node: str = "gamma", backing: int = HUGE_2M, **kw) -> SimVm:
        self.prepare(xml, node)
        return SimVm(
            xml,
            hardware=self.hw,
            fabric=self.fabric(node),
            ledger=RegistryWindowLedger(self.registry),
            backing=backing,
            **kw,
        )

    def runtime(self, kind: str = DMA_WINDOW):
        with self.registry.read() as tx:
            return tx.runtime(kind=kind)

    def claims(self):
        with self.registry.read() as tx:
            return sorted(tx.claims(), key=repr)

    def close(self) -> None:
        for f in self.fabrics.values():
            f.close()
        self.registry.close()


def domain_of(name: str, vm_uuid: str, fdids: tuple[int, ...]) -> bytes:
    """A 512 MiB domain ``name`` with UUID ``vm_uuid`` asking for the remote ``fdids``."""
    spec = DomainSpec(
        name=name,
        memory_bytes=512 * MiB,
        uuid=uuid.UUID(vm_uuid),
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def assert_matches_registry(cluster: Cluster, after: str = "") -> None:
    """Fail, listing every finding, when the cluster's hardware holds anything its registry
    does not justify (``vmlend.sim.invariants.check_with_registry``); ``after`` names the
    step just done, for the message."""
    found = check_with_registry(cluster.hw, cluster.registry)
    where = f"after {after}: " if after else ""
    assert not found, f"{where}{len(found)} violation(s):\n" + "\n".join(map(str, found))
