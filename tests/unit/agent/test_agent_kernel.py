"""``vmlend agent`` on the kernel backend (issue 22's defect): the agent works with any fabric
that keeps its bookkeeping in the registry and can take fenced devices back, and the kernel
backend takes a device back through the SmartIO driver's ``take_back`` attribute, with the
fence's token, before the fence is lifted. The driver is the fake of tests/support."""

from __future__ import annotations

from tests.support.cluster_hosts import Host
from tests.support.etcd_daemon import host_lease
from tests.support.fake_sysfs import FakeSmartio, FakeSysfs, populate_smartio
from tests.support.simfabric import make_fabric
from vmlend.fabric.base import RegistryFabric, TakesBack
from vmlend.kernel.backend import SmartioFabric
from vmlend.registry import open_registry, parse_location
from vmlend.registry.etcd_gateway import EtcdGateway
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import open_fabric

GPU = 0x10
WEB = Holder("gamma", "web", "11111111-1111-1111-1111-111111111111")


def _lender(etcd_url: str, root) -> tuple[SmartioFabric, FakeSmartio]:
    fake = FakeSysfs(root)
    smartio = FakeSmartio(fake, node_id=4)  # alpha
    with open_fabric(etcd_url, "alpha") as f:
        populate_smartio(smartio, f.topology())
    fabric = SmartioFabric(open_registry(etcd_url), fake.env, "alpha", writer=fake)
    return fabric, smartio


def test_the_kernel_backend_takes_a_fenced_device_back_through_the_driver(
    etcd, etcd_url, tmp_path, monkeypatch
):
    make_fabric(etcd_url).close()
    lease = host_lease(etcd, tmp_path / "gamma", ttl=60)
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "gamma"))
    with open_fabric(etcd_url, "gamma") as gamma:
        gamma.reserve(GPU, WEB)
        token = gamma.holds()[GPU].token
    # gamma's host vanishes: its lease ends, its hold goes, the fence stays
    EtcdGateway(parse_location(etcd_url).endpoints).call("kv/lease/revoke", {"ID": lease})
    alpha, smartio = _lender(etcd_url, tmp_path / "alpha-root")
    try:
        assert isinstance(alpha, RegistryFabric) and isinstance(alpha, TakesBack)
        (fence,) = alpha.fenced()
        assert (fence.fdid, fence.token) == (GPU, token)
        smartio.devs[GPU].token = token + 1  # a newer holder's step reached the device
        assert alpha.take_back(fence) is False  # a stale take-back is refused by the driver
        assert smartio.taken_back == [] and alpha.fenced() == [fence]
        smartio.devs[GPU].token = token
        assert alpha.take_back(fence) is True
        assert smartio.taken_back == [GPU]  # unmapped and reset by the driver, then...
        assert alpha.fenced() == []  # ...the fence lifted
    finally:
        alpha.close()


class KernelHost(Host):
    """A host whose fabric is the kernel backend over a fake sysfs under its root."""

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "VMLEND_BACKEND": "smartio"}


def test_the_agent_runs_on_the_kernel_backend(etcd_url, tmp_path):
    """It used to exit with "give --registry etcd://..." although it was given one, because
    it checked for the simulated backend's class."""
    make_fabric(etcd_url).close()
    host = KernelHost(etcd_url, "alpha", tmp_path / "alpha")
    smartio = FakeSmartio(FakeSysfs(host.root), node_id=4)
    with open_fabric(etcd_url, "alpha") as f:
        populate_smartio(smartio, f.topology())
    try:
        host.start_agent()  # publishes its lease: it runs, on the kernel backend
    finally:
        assert host.stop_agent() == 0, host.log()
