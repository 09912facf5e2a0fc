"""A real live migration of a TCG guest between two private libvirtds on this machine, each with
vmlend's hook installed, driven by ``vmlend.ops.live_migrate`` (what ``vmlend migrate --live``
runs) through ``LibvirtHypervisor.migrate_live`` (``migrateToURI3``, live + peer-to-peer).

Both daemons share one host name, so each has its own host UUID (else libvirt refuses a
migration "to the same host") and the memory goes over an explicit ``tcp://127.0.0.1:PORT``
(``VIR_MIGRATE_PARAM_URI``); the destination's QEMU listens on loopback only
(``VIR_MIGRATE_PARAM_LISTEN_ADDRESS``: libvirt refuses a loopback ``migration_address`` in
qemu.conf). libvirt refuses mdev
guests on this machine (no VFIO), so the guest carries vmlend's metadata without devices, as a
live migration leaves it once its remote devices are unplugged: the destination's migrate hook
must still rewrite it for its host."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import libvirt
import pytest
from lxml import etree

from tests.support.libvirt_daemon import LibvirtDaemon, need_private_libvirtd
from tests.support.simfabric import make_fabric
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain, read_domain
from vmlend.errors import MigrationError
from vmlend.hook.actionlog import ActionLog, log_path_for_state
from vmlend.hook.install import install_hook, uninstall_hook
from vmlend.hypervisor import LibvirtHypervisor, LiveMigration
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.live_state import history
from vmlend.topology.model import MiB
from vmlend.wiring.fabric import open_fabric
from vmlend.wiring.hypervisor import open_hypervisor

pytestmark = [pytest.mark.libvirtd, pytest.mark.slow]


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LibvirtDaemon, ...]]:
    """Two private libvirtds (gamma's and beta's), each with its own host UUID."""
    need_private_libvirtd()
    started: list[LibvirtDaemon] = []
    try:
        for name in ("src", "dst"):
            d = LibvirtDaemon(tmp_path_factory.mktemp(name), host_uuid=str(uuid.uuid4()))
            d.start()
            started.append(d)
        yield tuple(started)
    finally:
        survivors = [pid for d in started for pid in d.stop()]
        assert not survivors, f"processes left running after the daemons stopped: {survivors}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unplugged_guest(name: str) -> bytes:
    """A vmlend guest whose remote device was unplugged: vmlend's metadata, no device in it."""
    spec = DomainSpec(
        name=name,
        memory_bytes=64 * MiB,
        machine="pc",
        virt_type="qemu",
        devices=[DeviceRequest(0x10)],
    )
    root = etree.fromstring(new_domain(spec, templates=TemplateSet()).to_bytes())
    for hostdev in root.iterfind("devices/hostdev"):
        hostdev.getparent().remove(hostdev)
    for meta in root.iterfind("metadata/*"):
        for child in list(meta):
            meta.remove(child)
    return etree.tostring(root)


@pytest.fixture
def hosts(daemons, state_path) -> Iterator[tuple[LibvirtHypervisor, LibvirtHypervisor]]:
    """vmlend's hook in both daemons (gamma = source, beta = destination), one fabric."""
    make_fabric(state_path).close()
    src_d, dst_d = daemons
    for d, node in ((src_d, "gamma"), (dst_d, "beta")):
        # backend = "sim" chosen, as the other real-libvirtd tests (vmlend.hook.simulated)
        assert not install_hook(d.hooks_dir.parent, state_path, node, backend="sim").restart_needed
    src = open_hypervisor(src_d.uri, state_dir=state_path.parent, hook_command=None, node="gamma")
    dst = open_hypervisor(dst_d.uri, state_dir=state_path.parent, hook_command=None, node="beta")
    assert isinstance(src, LibvirtHypervisor) and isinstance(dst, LibvirtHypervisor)
    try:
        yield src, dst
    finally:
        for hv in (src, dst):
            for info in hv.list_domains():
                if info.active:
                    hv.destroy(info.name)
                if hv.lookup(info.name).persistent:
                    hv.undefine(info.name)
            hv.close()
        for d in daemons:
            uninstall_hook(d.hooks_dir.parent)


def run(hosts, state_path, name, uri=None, **how):
    src, dst = hosts
    uri = uri or f"tcp://127.0.0.1:{free_port()}"
    with open_fabric(state_path, "gamma") as f, open_fabric(state_path, "beta") as g:
        return live_migrate(
            src,
            dst,
            f,
            g,
            name,
            "beta",
            how=LiveMigration(migration_uri=uri, listen_address="127.0.0.1", **how),
            state_dir=state_path.parent,
        )


def test_running_guest_moves_live_and_the_destination_hook_rewrites_it(hosts, state_path):
    src, dst = hosts
    name = f"lm-{uuid.uuid4().hex[:8]}"
    src.define(unplugged_guest(name))
    src.start(name)
    assert read_domain(src.xml(name)).host_node is None
    res = run(hosts, state_path, name, persistent=True, undefine_source=True)
    assert dst.lookup(name).active and dst.lookup(name).persistent
    assert [d.name for d in src.list_domains()] == []
    # The destination's hook saw the live migration and rewrote the XML for its host.
    assert read_domain(dst.xml(name)).host_node == "beta"
    assert read_domain(dst.xml(name, inactive=True)).host_node == "beta"
    lines = ActionLog(log_path_for_state(state_path)).tail(200)
    mine = [ln.split(" ", 2)[2] for ln in lines if f" vm={name} " in ln]
    assert mine.count(f"vm={name} migrate: rewrote XML for beta") == 1, mine
    # libvirt measured the downtime; the history keeps it.
    assert res.downtime is not None and res.downtime >= 0
    (rec,) = history(state_path.parent, name)
    assert (rec.source, rec.destination, rec.downtime) == ("gamma", "beta", res.downtime)


def test_a_refused_migration_leaves_the_guest_running_on_the_source(hosts, state_path):
    src, dst = hosts
    name = f"lm-{uuid.uuid4().hex[:8]}"
    src.define(unplugged_guest(name))
    src.start(name)
    # Nothing listens where the memory should go: the source's QEMU cannot connect.
    with pytest.raises(MigrationError, match="it runs on gamma with all its devices, as before"):
        run(hosts, state_path, name, uri="tcp://127.0.0.2:1")
    assert src.lookup(name).active
    with pytest.raises(libvirt.libvirtError):
        dst.conn.lookupByName(name)


def cli(state_path, *args):
    from click.testing import CliRunner

    from vmlend.cli import main

    return CliRunner().invoke(main, ["--state", str(state_path), *args])


def test_the_cli_moves_it_live_and_back(daemons, hosts, state_path):
    src, dst = hosts
    name = f"lm-{uuid.uuid4().hex[:8]}"
    src.define(unplugged_guest(name))
    src.start(name)
    how = ("--live", "--listen-address", "127.0.0.1", "--persistent", "--undefinesource")
    there = ("--to", "beta", "-c", daemons[0].uri, "--dest-uri", daemons[1].uri)
    uri = ("--migrate-uri", f"tcp://127.0.0.1:{free_port()}")
    out = cli(state_path, "migrate", name, *how, *there, *uri)
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith(f"migrated VM '{name}' live from gamma to beta (running)")
    assert dst.lookup(name).active and [d.name for d in src.list_domains()] == []
    # Back again, run as beta's host would run it.
    back = ("--to", "gamma", "-c", daemons[1].uri, "--dest-uri", daemons[0].uri)
    uri = ("--migrate-uri", f"tcp://127.0.0.1:{free_port()}")
    out = cli(state_path, "--node", "beta", "migrate", name, *how, *back, *uri)
    assert out.exit_code == 0, out.output
    assert src.lookup(name).active and read_domain(src.xml(name)).host_node == "gamma"
    assert [(r.source, r.destination) for r in history(state_path.parent, name)] == [
        ("gamma", "beta"),
        ("beta", "gamma"),
    ]
