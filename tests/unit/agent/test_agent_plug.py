"""Issue 24's gap: a live migration on the kernel backend, where the destination's ``vmlend
agent`` plugs the VM's devices back (answering the source's plug request) and their mdevs
appear in the destination host's sysfs, not the source's. Two hosts on one etcd, each with its
own fake sysfs and SmartIO driver, simulated hypervisors; the destination's agent runs on a
thread of this process (the fake sysfs lives here) and is stopped through its stop event."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from tests.support.cluster_hosts import domain_xml
from tests.support.etcd_daemon import host_lease
from tests.support.fake_sysfs import FakeSmartio, FakeSysfs, populate_smartio
from tests.support.hostroot import identify
from tests.support.simfabric import make_fabric
from vmlend.agent.service import Agent, AgentConfig
from vmlend.domain import mdev_uuid, read_domain
from vmlend.domain.address import PciAddress
from vmlend.errors import MigrationError, StateError
from vmlend.hostenv import HostEnv
from vmlend.hypervisor import Hypervisor, LiveMigration
from vmlend.hypervisor.base import DomainState
from vmlend.kernel.backend import SmartioFabric
from vmlend.messages import single_line
from vmlend.notify import Notifier
from vmlend.ops.attach import apply_attach, plan_attach
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.live_state import LiveDevice, load_journal
from vmlend.ops.plug_request import PlugRequest, PlugRequests, plug_remotely, serve_plug_request
from vmlend.registry import hostlease, open_registry
from vmlend.registry.etcd_gateway import b64
from vmlend.registry.etcd_store import EtcdRegistry
from vmlend.wiring.fabric import open_fabric
from vmlend.wiring.hypervisor import open_hypervisor

GPU, NVME = 0x10, 0x12
ADDRS = {GPU: "0000:00:0a.0", NVME: "0000:00:0b.0"}
VM_UUID = "33333333-3333-3333-3333-333333333333"


class KernelHost:
    """One host: its root, fake sysfs and SmartIO driver, and its simulated hypervisor."""

    def __init__(self, url: str, node: str, root: Path, hv_dir: Path) -> None:
        self.url, self.node, self.root = url, node, root
        self.fake = FakeSysfs(root)
        with open_fabric(url, node, backend="sim") as f:
            topo = f.topology()
        self.smartio = FakeSmartio(self.fake, node_id=topo.node(node).node_id)
        populate_smartio(self.smartio, topo)
        self.hv_dir = hv_dir
        self.lease_file = hostlease.lease_path(HostEnv(root))
        identify(root)

    def fabric(self) -> SmartioFabric:
        registry = open_registry(self.url, self.lease_file)
        return SmartioFabric(registry, self.fake.env, self.node, writer=self.fake)

    def hv(self):  # type: ignore[no-untyped-def]
        return open_hypervisor(f"sim:///{self.node}", state_dir=self.hv_dir, hook_command=None)

    def mdevs(self) -> set[str]:
        """The mdevs in this host's (fake) sysfs."""
        return set(self.fake._children)


class ReadyNotifier(Notifier):
    def __init__(self) -> None:
        super().__init__()
        self.serving = threading.Event()

    def ready(self, status: str) -> bool:
        self.serving.set()
        return super().ready(status)


class AgentThread:
    """The agent of ``host`` on a thread; entered once it serves (systemd's "ready")."""

    def __init__(
        self,
        host: KernelHost,
        hypervisor: bool = True,
        *,
        ttl: int = 10,
        hv: Callable[[], Hypervisor] | None = None,
    ) -> None:
        self.notifier = ReadyNotifier()
        cfg = AgentConfig(
            location=host.url,
            node=host.node,
            lease_file=host.lease_file,
            ttl=ttl,
            interval=0.05,
            hypervisor=(hv or host.hv) if hypervisor else None,
            fabric=host.fabric,
            notifier=self.notifier,
            host=HostEnv(host.root),
        )
        self.agent = Agent(cfg)
        self.thread = threading.Thread(target=self.agent.run, daemon=True)

    def __enter__(self) -> Agent:
        self.thread.start()
        while not self.notifier.serving.wait(0.05):
            assert self.thread.is_alive(), "the agent stopped before it served"
        return self.agent

    def __exit__(self, *exc: object) -> None:
        self.agent.stop_event.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def hosts(etcd, etcd_url, tmp_path):
    make_fabric(etcd_url).close()
    gamma = KernelHost(etcd_url, "gamma", tmp_path / "gamma", tmp_path)
    beta = KernelHost(etcd_url, "beta", tmp_path / "beta", tmp_path)
    host_lease(etcd, gamma.root, node="gamma", ttl=600)  # the source's agent, as a stand-in
    return gamma, beta


def running_on_gamma(gamma: KernelHost, fdids: tuple[int, ...]) -> None:
    hv = gamma.hv()
    hv.define(domain_xml("vm1", VM_UUID, ()))
    hv.start("vm1")
    with gamma.fabric() as fabric:
        for fdid in fdids:
            plan = plan_attach(
                hv,
                fabric,
                "vm1",
                fdid,
                live=True,
                config=False,
                address=PciAddress.parse(ADDRS[fdid]),
            )
            assert plan.ok, plan.checks
            apply_attach(hv, fabric, plan, lambda _m: None)
    assert gamma.mdevs() == {str(mdev_uuid(uuid.UUID(VM_UUID), f)) for f in fdids}


def migrate(gamma: KernelHost, beta: KernelHost, tmp_path: Path, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    steps: list[str] = []
    with gamma.fabric() as fabric:
        assert isinstance(fabric.registry, EtcdRegistry)
        res = live_migrate(
            gamma.hv(),
            beta.hv(),
            fabric,
            None,
            "vm1",
            "beta",
            how=LiveMigration(),
            state_dir=tmp_path,
            plugs=PlugRequests(fabric.registry),
            plug_timeout=timeout,
            progress=steps.append,
        )
    return res, steps


def guest_fdids(host: KernelHost) -> set[int]:
    return {d.fdid for d in read_domain(host.hv().xml("vm1"), strict=False).devices}


def plug_keys(gamma: KernelHost) -> list[object]:
    with gamma.fabric() as fabric:
        assert isinstance(fabric.registry, EtcdRegistry)
        prefix = fabric.registry.keys.plugs
        return fabric.registry.gateway.range(prefix, prefix[:-1] + "0")[1]


def holders(gamma: KernelHost) -> dict[int, str]:
    with gamma.fabric() as f:
        return {d.fdid: str(d.holder) for d in f.devices() if d.holder}


def test_the_destination_agent_plugs_the_devices_back_in_its_own_sysfs(hosts, tmp_path):
    gamma, beta = hosts
    running_on_gamma(gamma, (GPU, NVME))
    with AgentThread(beta) as agent:
        res, steps = migrate(gamma, beta, tmp_path)
        # on beta's lease: they go with it when its agent stops
        assert holders(gamma) == {GPU: "beta/vm1", NVME: "beta/vm1"}
    assert res.devices == ["0x10", "0x12"]
    assert "asked beta's agent to plug 2 device(s) back into vm1: waiting up to 30 s for it" in (
        steps
    )
    assert beta.mdevs() == {str(mdev_uuid(uuid.UUID(VM_UUID), f)) for f in (GPU, NVME)}
    assert gamma.mdevs() == set()  # created by the destination, in its own sysfs
    assert guest_fdids(beta) == {GPU, NVME}
    assert beta.hv().lookup("vm1").active and not gamma.hv().lookup("vm1").active
    assert [r.vm for r in agent.plugged] == ["vm1"]
    assert plug_keys(gamma) == []  # read by the source, then deleted
    assert load_journal(tmp_path, "vm1") is None


def test_a_failed_plug_leaves_the_vm_running_without_the_device_and_a_rerun_finishes(
    hosts, tmp_path
):
    gamma, beta = hosts
    running_on_gamma(gamma, (GPU,))
    beta.smartio.set_availability(GPU, "unreachable")  # beta cannot borrow it just now
    with AgentThread(beta):
        with pytest.raises(MigrationError) as e:
            migrate(gamma, beta, tmp_path)
        msg = str(e.value)
        assert msg.startswith("VM 'vm1' runs on beta without device(s) 0x10: ")
        assert msg.endswith(
            "once that is fixed, run 'vmlend migrate vm1 --to beta --live' again to plug them back"
        )
        assert beta.hv().lookup("vm1").active and guest_fdids(beta) == set()
        assert beta.mdevs() == set() and gamma.mdevs() == set()
        assert holders(gamma) == {}  # the agent's failed attach undid its reservation
        assert plug_keys(gamma) == []
        beta.smartio.set_availability(GPU, "available")
        res, _steps = migrate(gamma, beta, tmp_path)
    assert res.resumed and res.devices == ["0x10"]
    assert beta.mdevs() == {str(mdev_uuid(uuid.UUID(VM_UUID), GPU))}
    assert guest_fdids(beta) == {GPU}


def test_an_agent_that_died_mid_request_is_finished_by_a_rerun(hosts, etcd, tmp_path):
    gamma, beta = hosts
    running_on_gamma(gamma, (GPU, NVME))
    # beta's agent was killed: its lease (published, never withdrawn) and the host key on it
    # outlive it for the TTL. Nobody answers: the source gives up, says what is missing, and
    # withdraws its request.
    lease = host_lease(etcd, beta.root, node="beta", ttl=600)
    with gamma.fabric() as fabric:
        assert isinstance(fabric.registry, EtcdRegistry)
        key = fabric.registry.keys.host("beta")
        fabric.registry.gateway.call(
            "kv/put", {"key": b64(key), "value": b64(b'{"plugs": true}'), "lease": lease}
        )
    with pytest.raises(MigrationError) as e:
        migrate(gamma, beta, tmp_path, timeout=0.3)
    assert "without device(s) 0x10, 0x12: beta's agent did not answer within 0.3 s" in str(e.value)
    assert plug_keys(gamma) == []
    # Had it plugged the first device before it died, under that lease (the next agent takes
    # the records on it over):
    req = PlugRequest(
        VM_UUID, "vm1", VM_UUID, "beta", "gamma", [LiveDevice(GPU, PciAddress.parse(ADDRS[GPU]))]
    )
    with beta.fabric() as fabric:
        assert serve_plug_request(beta.hv(), fabric, req)[0].plugged
    assert guest_fdids(beta) == {GPU}
    with AgentThread(beta) as agent:
        res, _steps = migrate(gamma, beta, tmp_path)
    assert res.resumed and res.devices == ["0x10", "0x12"]
    (served,) = agent.plugged
    assert [d.fdid for d in served.devices] == [NVME]  # only what was still missing
    assert guest_fdids(beta) == {GPU, NVME}
    assert beta.mdevs() == {str(mdev_uuid(uuid.UUID(VM_UUID), f)) for f in (GPU, NVME)}
    assert gamma.mdevs() == set()


def test_a_request_for_a_vm_not_running_on_the_node_is_refused(hosts, tmp_path):
    from vmlend.ops.migration_record import MigrationRecord

    gamma, beta = hosts
    beta.hv().define(domain_xml("vm1", VM_UUID, ()))  # defined on beta, not running
    req = PlugRequest(VM_UUID, "vm1", VM_UUID, "beta", "gamma", [LiveDevice(GPU)], tokens={GPU: 7})
    with AgentThread(beta), gamma.fabric() as fabric:
        assert isinstance(fabric.registry, EtcdRegistry)
        requests = PlugRequests(fabric.registry)
        # the registry shows the migration (else the request is refused before any look)
        requests.migrations.begin(MigrationRecord("vm1", VM_UUID, "gamma", "beta", {GPU: 7}))
        (out,) = plug_remotely(requests, req, timeout=30, progress=lambda _m: None)
    assert (out.fdid, out.plugged, out.reason) == (GPU, False, "VM 'vm1' is not running on beta")
    assert beta.mdevs() == set() and holders(gamma) == {}
    assert plug_keys(gamma) == []


@pytest.mark.parametrize("agent", ["none", "without a hypervisor"])
def test_without_an_agent_that_plugs_on_the_destination_nothing_is_changed(hosts, tmp_path, agent):
    gamma, beta = hosts
    running_on_gamma(gamma, (GPU,))
    with contextlib.ExitStack() as stack:
        if agent != "none":
            stack.enter_context(AgentThread(beta, hypervisor=False))
        with pytest.raises(MigrationError) as e:
            migrate(gamma, beta, tmp_path)
    assert str(e.value) == (
        "no vmlend agent with a hypervisor (-c) runs on beta, which plugs the devices of 'vm1'"
        " back in after a live migration on the kernel backend; start 'vmlend agent -c URI'"
        " there, then retry; nothing was changed"
    )
    assert gamma.hv().lookup("vm1").active and guest_fdids(gamma) == {GPU}
    assert gamma.mdevs() == {str(mdev_uuid(uuid.UUID(VM_UUID), GPU))}
    assert holders(gamma) == {GPU: "gamma/vm1"}
    assert load_journal(tmp_path, "vm1") is None and plug_keys(gamma) == []


class StuckHotPlug:
    """``host``'s hypervisor (``hv``, for its agent) with a hot-plug that hangs until
    ``answer`` is set: ``attaching`` once it hangs, ``landed`` once the device is in."""

    def __init__(self, host: KernelHost) -> None:
        self.host = host
        self.attaching, self.answer, self.landed = (threading.Event() for _ in range(3))

    def hv(self) -> Hypervisor:
        hv = self.host.hv()
        attach = hv.attach_device

        def hanging(*args, **kw):  # type: ignore[no-untyped-def]
            self.attaching.set()
            self.answer.wait(60)
            attach(*args, **kw)
            self.landed.set()

        hv.attach_device = hanging  # type: ignore[method-assign]
        return hv


def test_a_plug_the_hypervisor_does_not_answer_holds_up_no_renewal(hosts, tmp_path):
    """The destination's hypervisor hangs in the hot-plug of a plug request. The agent must
    renew on meanwhile (it used to serve plug requests on its loop: the lease, and every hold
    of the host, would have ended while etcd answered); the plug lands once it answers."""
    gamma, beta = hosts
    running_on_gamma(gamma, (GPU,))
    stuck = StuckHotPlug(beta)
    # a TTL of 2 s: renewed every 2/3 s
    with AgentThread(beta, ttl=2, hv=stuck.hv) as agent:
        result: list[object] = []
        migration = threading.Thread(target=lambda: result.append(migrate(gamma, beta, tmp_path)))
        try:
            migration.start()
            assert stuck.attaching.wait(30), "the plug request was never served"
            before = agent.renewals
            deadline = time.monotonic() + 20
            while agent.renewals < before + 2:
                assert time.monotonic() < deadline, "no renewal while the hot-plug hung"
                time.sleep(0.05)
            stuck.answer.set()
            migration.join(60)
            res, _steps = result[0]  # type: ignore[misc]
            assert res.devices == ["0x10"] and guest_fdids(beta) == {GPU}
            assert holders(gamma) == {GPU: "beta/vm1"}
        finally:
            stuck.answer.set()
            migration.join(60)


def test_a_plug_that_lands_after_the_lease_was_lost_does_not_leave_the_vm_running_on_it(
    hosts, etcd, tmp_path
):
    """The destination's hot-plug hangs with the device reserved under its agent's lease, and
    that lease ends meanwhile (revoked here, as etcd does when it expires): the hold goes with
    it, and neither the guard's pause nor the recovery knows the VM has the device (it is not
    in the XML yet). When the hot-plug lands, the VM must not run on with a device it does
    not hold: the attach finds its hold gone and takes the device out again (and the watch,
    looking again after the plug, pauses the VM for the recovery); the source is told the VM
    runs without it."""
    gamma, beta = hosts
    running_on_gamma(gamma, (GPU,))
    stuck = StuckHotPlug(beta)
    failed: list[MigrationError] = []

    def migration_run() -> None:
        try:
            migrate(gamma, beta, tmp_path)
        except MigrationError as e:
            failed.append(e)

    with AgentThread(beta, ttl=2, hv=stuck.hv):
        migration = threading.Thread(target=migration_run, daemon=True)
        try:
            migration.start()
            assert stuck.attaching.wait(30), "the plug request was never served"
            old = hostlease.read(beta.lease_file).lease
            body = json.dumps({"ID": old}).encode()
            req = urllib.request.Request(f"http://{etcd.endpoint}/v3/lease/revoke", data=body)
            urllib.request.urlopen(req, timeout=5).close()
            deadline = time.monotonic() + 30
            while (now := _published(beta)) in (None, old):
                assert time.monotonic() < deadline, "the agent never took a new lease"
                time.sleep(0.05)
            stuck.answer.set()  # the hot-plug lands, under a lease that is gone
            migration.join(60)
            assert not migration.is_alive() and stuck.landed.is_set()
            assert failed and "its hold ended meanwhile" in str(failed[0])
            deadline = time.monotonic() + 30
            while not _settled(beta):
                assert time.monotonic() < deadline, (
                    f"vm1 runs with {guest_fdids(beta)} while holders are {holders(gamma)}"
                )
                time.sleep(0.05)
            assert _published(beta) == now  # the recovery kept the new lease
        finally:
            stuck.answer.set()
            migration.join(60)


def _published(host: KernelHost) -> int | None:
    try:
        return hostlease.read(host.lease_file).lease
    except StateError:
        return None


def _settled(beta: KernelHost) -> bool:
    """vm1 runs on beta, and a device in its guest is one it holds."""
    info = beta.hv().lookup("vm1")
    if info.state is not DomainState.RUNNING:
        return False
    held = {f for f, who in holders(beta).items() if who == "beta/vm1"}
    return guest_fdids(beta) <= held


# --- trust: a plug request is acted on only for a live migration in progress (issue 37.1) ---
def registry_of(host: KernelHost) -> EtcdRegistry:
    registry = open_registry(host.url, host.lease_file)
    assert isinstance(registry, EtcdRegistry)
    return registry


def migration_keys(gamma: KernelHost) -> list[object]:
    with registry_of(gamma) as registry:
        prefix = registry.keys.base + "migrations/"
        return registry.gateway.range(prefix, prefix[:-1] + "0")[1]


def put_raw(host: KernelHost, key: str | bytes, value: bytes, leased: bool = False) -> None:
    """Write ``value`` at ``key`` under the cluster's prefix as any host may (raw: neither
    request nor record need be one vmlend would write)."""
    with registry_of(host) as registry:
        raw = registry.keys.base.encode() + (key.encode() if isinstance(key, str) else key)
        body: dict[str, object] = {"key": b64(raw), "value": b64(value)}
        if leased:
            body["lease"] = hostlease.read(host.lease_file).lease
        registry.gateway.call("kv/put", body)


def raw_request(host: KernelHost, request_id: str) -> dict[str, object] | None:
    with registry_of(host) as registry:
        value = PlugRequests(registry).store.get("beta", request_id)
    return None if value is None else json.loads(value)


def wait_answered(host: KernelHost, request_id: str) -> dict[str, object]:
    deadline = time.monotonic() + 20
    while True:
        got = raw_request(host, request_id)
        assert got is not None, "the request went away unanswered"
        if got.get("outcome") is not None or got.get("refused") is not None:
            return got
        assert time.monotonic() < deadline, "the agent never answered the request"
        time.sleep(0.05)


def running_on_beta(beta: KernelHost) -> None:
    """vm1 runs on beta with no remote device, and is not migrating."""
    hv = beta.hv()
    hv.define(domain_xml("vm1", VM_UUID, ()))
    hv.start("vm1")


def _record(**change: object) -> bytes:
    """The registry's record of vm1's live migration from gamma to beta (docs/migration.md)."""
    record: dict[str, object] = {
        "version": 1,
        "vm": "vm1",
        "vm_uuid": VM_UUID,
        "source": "gamma",
        "destination": "beta",
        "devices": {str(GPU): 7},
    }
    return json.dumps(record | change).encode()


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


@pytest.mark.parametrize(
    "record",
    [
        None,  # nothing migrates
        _record(source="alpha"),  # another source
        _record(vm_uuid="44444444-4444-4444-4444-444444444444"),  # another VM's, at this key
        _record(devices={str(NVME): 7}),  # not this device
        _record(devices={str(GPU): 8}),  # another hold's token
    ],
    ids=["no-record", "other-source", "other-vm", "other-device", "other-token"],
)
def test_a_forged_plug_request_is_refused_and_nothing_is_reserved_or_plugged(
    hosts, tmp_path, caplog, record
):
    """Any host that can write the registry could make beta's agent reserve an available
    device and hot-plug it into beta's running vm1, which is not migrating. Now the request is
    answered with one refusal and nothing is reserved, created or plugged."""
    caplog.set_level(logging.INFO, logger="vmlend")
    gamma, beta = hosts
    running_on_beta(beta)
    if record is not None:
        put_raw(gamma, f"migrations/{VM_UUID}", record, leased=True)
    forged = PlugRequest(
        VM_UUID,
        "vm1",
        VM_UUID,
        "beta",
        "gamma",
        [LiveDevice(GPU, PciAddress.parse(ADDRS[GPU]))],
    )
    forged_json = json.loads(msgspec.json.encode(forged))
    forged_json["tokens"] = {str(GPU): 7}
    put_raw(gamma, f"plugs/beta/{VM_UUID}", json.dumps(forged_json).encode())
    with AgentThread(beta):
        answer = wait_answered(gamma, VM_UUID)
    assert holders(gamma) == {}  # nothing reserved
    assert guest_fdids(beta) == set() and beta.mdevs() == set()  # nothing created or plugged
    assert answer["outcome"] == []
    refused = answer["refused"]
    assert isinstance(refused, str) and "\n" not in refused
    assert refused.endswith("nothing was plugged")
    assert len(_lines(caplog, f"refused plugs/beta/{VM_UUID}")) == 1


def test_garbage_under_a_nodes_plugs_is_removed_with_one_line_and_a_request_after_it_served(
    hosts, tmp_path, caplog
):
    """Values that are no plug request stopped beta's plug service (a traceback every pass, or
    a pass that failed as a whole every time) and a valid request then got no answer. Each is
    now removed with one log line, and the live migration after them is served."""
    caplog.set_level(logging.INFO, logger="vmlend")
    gamma, beta = hosts
    running_on_gamma(gamma, (GPU,))
    bad_address = {
        "id": "bad-address",
        "vm": "vm1",
        "vm_uuid": VM_UUID,
        "node": "beta",
        "source": "gamma",
        "devices": [{"fdid": GPU, "address": {"domain": 0, "bus": 999, "slot": 0, "function": 0}}],
    }
    garbage: dict[bytes, bytes] = {
        b"not-json": b"\xff\xfe not JSON",
        b"not-a-request": b'{"id": 5}',
        b"bad-address": json.dumps(bad_address).encode(),
        b"key-\xff-not-utf8": b"{}",
    }
    for key, value in garbage.items():
        put_raw(gamma, b"plugs/beta/" + key, value)
    with AgentThread(beta):
        res, _steps = migrate(gamma, beta, tmp_path, timeout=20)
        deadline = time.monotonic() + 10
        while plug_keys(gamma):
            assert time.monotonic() < deadline, f"left under plugs/: {plug_keys(gamma)}"
            time.sleep(0.05)
    assert res.devices == ["0x10"] and guest_fdids(beta) == {GPU}
    for key in garbage:
        name = single_line(key.decode(errors="surrogateescape"))  # as the log escapes it
        assert len(_lines(caplog, f"removed plugs/beta/{name}:")) == 1, name
    assert migration_keys(gamma) == []  # the migration ended: its record went with it


def test_a_value_over_64_kib_is_removed_and_a_request_over_64_devices_refused(hosts, caplog):
    caplog.set_level(logging.INFO, logger="vmlend")
    gamma, beta = hosts
    running_on_beta(beta)
    big = PlugRequest("big", "vm1", VM_UUID, "beta", "gamma", [LiveDevice(GPU)])
    value = msgspec.json.encode(big)
    value = value[:-1] + b', "pad": "' + b"x" * (64 * 1024) + b'"}'  # valid JSON, 64 KiB+
    put_raw(gamma, "plugs/beta/big", value)
    many = PlugRequest(
        "many", "vm1", VM_UUID, "beta", "gamma", [LiveDevice(0x1000 + i) for i in range(65)]
    )
    put_raw(gamma, "plugs/beta/many", msgspec.json.encode(many))
    with AgentThread(beta):
        answer = wait_answered(gamma, "many")
        deadline = time.monotonic() + 10
        while raw_request(gamma, "big") is not None:
            assert time.monotonic() < deadline, "the value over 64 KiB was never removed"
            time.sleep(0.05)
    assert answer["outcome"] == [] and "over the limit of 64" in str(answer["refused"])
    assert holders(gamma) == {} and guest_fdids(beta) == set()
    [line] = _lines(caplog, "removed plugs/beta/big:")
    assert f"over the limit of {64 * 1024}" in line
    assert len(_lines(caplog, "refused plugs/beta/many")) == 1
