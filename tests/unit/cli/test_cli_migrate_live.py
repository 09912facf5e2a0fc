"""``vmlend migrate --live`` between simulated nodes running the real vmlend hook: the VM keeps
running, its remote devices leave the guest on the source and come back on the destination at
the same guest addresses; admission comes first; a failure converges (back on the source before
the move, on the destination after it, with the missing devices named); a re-run finishes."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_cluster import GAMMA, SimCluster, hostdev_uuids, make_cluster, one_line
from tests.support.simfabric import small_topology
from vmlend.domain import read_domain
from vmlend.domain.document import DomainDocument
from vmlend.domain.model import DomainXML
from vmlend.errors import DomainOperationError, MigrationError
from vmlend.hypervisor import LiveMigration
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.live_state import history, load_journal
from vmlend.sim.hypervisor.node import IdleGuest, SimHypervisor

LIVE = ("migrate", "vm1", "--to", "beta", "--live", *GAMMA)
#: The unplugged way, for devices that could stay plugged (tests/unit/ops/test_hot_move.py
#: covers the hot way, the default for them).
UNPLUG = (*LIVE, "--unplug")


def guest_addresses(xml: bytes) -> dict[int, str]:
    """fdid -> the guest PCI address of its hostdev, from a live XML."""
    dom = read_domain(xml)
    doc = DomainDocument.parse(xml)
    by_mdev = {str(h.uuid): h.guest_address for h in DomainXML(doc.root).mdev_hostdevs()}
    return {d.fdid: str(d.address or by_mdev[str(d.mdev)]) for d in dom.devices}


def running_with(cluster: SimCluster, fdids: dict[int, str], *flags: str) -> None:
    """vm1 running on gamma with ``fdids`` hot-plugged at the given guest addresses
    (``flags``: attach's, e.g. ``--live --config`` to add them to its definition too)."""
    cluster.define("gamma", "vm1", running=True)
    for fdid, address in fdids.items():
        r = cluster.cli("attach", "vm1", hex(fdid), "--address", address, *flags, *GAMMA)
        assert r.exit_code == 0, r.output


def where(cluster: SimCluster) -> dict[str, tuple[str, bool]]:
    out = {}
    for node in ("alpha", "beta", "gamma"):
        for info in cluster.hv(node).list_domains():
            if info.name == "vm1":
                out[node] = (info.state.value, info.persistent)
    return out


ADDRS = {0x10: "0000:00:0a.0", 0x12: "0000:00:0b.0"}


def test_running_vm_moves_live_and_gets_its_devices_back_at_the_same_addresses(cluster):
    running_with(cluster, ADDRS)
    r = cluster.cli(*UNPLUG)
    assert r.exit_code == 0, r.output
    assert "--unplug: VM 'vm1' moves with its devices unplugged" in r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(
        "migrated VM 'vm1' live from gamma to beta (running), devices 0x10, 0x12; downtime "
    )
    assert [ln.split(": blackout ")[0] for ln in lines[1:]] == ["  device 0x10", "  device 0x12"]
    assert "waiting up to 10 s for the guest to let go" in r.stderr  # the wait is never silent
    beta = cluster.hv("beta")
    assert where(cluster) == {"beta": ("running", False), "gamma": ("shutoff", True)}
    live = beta.xml("vm1")
    assert guest_addresses(live) == {0x10: "0000:00:0a.0", 0x12: "0000:00:0b.0"}
    assert read_domain(live).host_node == "beta"  # the destination's migrate hook rewrote it
    assert cluster.holds() == {0x10: "beta/vm1", 0x12: "beta/vm1"}
    assert {f for _u, f in cluster.mdevs("beta")} == {0x10, 0x12}
    assert cluster.mdevs("gamma") == set()
    assert load_journal(cluster.state_path.parent, "vm1") is None


def test_persistent_and_undefinesource_move_the_definition(cluster):
    running_with(cluster, {0x10: "0000:00:0a.0"}, "--live", "--config")
    r = cluster.cli(*LIVE, "--persistent", "--undefinesource", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["live"] is True and data["devices"] == ["0x10"]
    assert data["downtime"] >= 0 and data["blackout"]["0x10"] > 0
    assert where(cluster) == {"beta": ("running", True)}
    beta = cluster.hv("beta")
    config = read_domain(beta.xml("vm1", inactive=True))
    assert config.host_node == "beta" and [d.fdid for d in config.devices] == [0x10]
    # It stops and starts there like any VM of beta: the hook returns and borrows again.
    beta.destroy("vm1")
    assert cluster.holds() == {}
    beta.start("vm1")
    assert cluster.holds() == {0x10: "beta/vm1"}


def test_history_is_kept_and_status_shows_it(cluster):
    running_with(cluster, {0x10: "0000:00:0a.0"})
    assert cluster.cli(*LIVE).exit_code == 0
    back = cluster.cli("migrate", "vm1", "--to", "gamma", "--live", "-c", "sim:///beta")
    assert back.exit_code == 0, back.output
    recs = history(cluster.state_path.parent, "vm1")
    assert [(r.source, r.destination) for r in recs] == [("gamma", "beta"), ("beta", "gamma")]
    assert all(r.blackout[0x10] is not None and r.downtime is not None for r in recs)
    st = cluster.cli("status", "vm1", *GAMMA, "--json")
    assert st.exit_code == 0, st.output
    (vm,) = json.loads(st.stdout)["vms"]
    assert [(m["from"], m["to"]) for m in vm["live_migrations"]] == [
        ("gamma", "beta"),
        ("beta", "gamma"),
    ]
    assert set(vm["live_migrations"][0]["blackout"]) == {"0x10"}
    text = cluster.cli("status", "vm1", *GAMMA)
    assert text.exit_code == 0, text.output
    assert "live migrations:" in text.stdout
    assert "gamma -> beta" in text.stdout and "0x10 blackout" in text.stdout


def test_a_vm_without_remote_devices_moves_live_too(cluster):
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli(*LIVE)
    assert r.exit_code == 0, r.output
    assert "devices none" in r.stdout
    assert where(cluster)["beta"] == ("running", False)


# --- refusals: one line, nothing changed -----------------------------------------------------


def test_unknown_node_changes_nothing(cluster):
    running_with(cluster, {0x10: "0000:00:0a.0"})
    before = cluster.snapshot()
    line = one_line(cluster.cli("migrate", "vm1", "--to", "delta", "--live", *GAMMA))
    assert line == "Error: unknown node 'delta'; 'vmlend fabric show' lists the nodes"
    assert cluster.snapshot() == before


def test_admission_comes_first_a_node_that_cannot_reach_the_lender(state_path, monkeypatch):
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    cluster = make_cluster(state_path, small_topology(isolated=True), node="b")
    cluster.define("b", "vm1", [0x100], running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("migrate", "vm1", "--to", "x", "--live", "-c", "sim:///b"))
    assert line.startswith("Error: cannot migrate VM 'vm1' to x: device 0x100: ")
    assert "no NTB path" in line and line.endswith("nothing was changed")
    assert cluster.snapshot() == before  # the device never left the guest


def test_the_kernel_backend_without_a_cluster_registry_is_refused(cluster, monkeypatch):
    """The destination's agent plugs the devices back, asked through etcd
    (tests/unit/agent/test_agent_plug.py); an SQLite state has no other host to ask."""
    running_with(cluster, {0x10: "0000:00:0a.0"})
    before = cluster.snapshot()
    monkeypatch.setenv("VMLEND_BACKEND", "smartio")
    line = one_line(cluster.cli(*LIVE))
    assert line == (
        "Error: a live migration on the kernel backend needs the destination's agent to plug"
        " the devices back, asked through a cluster registry: give --registry"
        " etcd://HOST:PORT/CLUSTER, or move the VM cold (leave out --live)"
    )
    monkeypatch.delenv("VMLEND_BACKEND")
    assert cluster.snapshot() == before


def test_not_running_is_refused(cluster):
    cluster.define("gamma", "vm1", [0x10])
    before = cluster.snapshot()
    line = one_line(cluster.cli(*LIVE))
    assert line == (
        "Error: VM 'vm1' is not running on gamma; a live migration moves a running VM"
        " (leave out --live to move it cold)"
    )
    assert cluster.snapshot() == before


def test_same_name_on_the_destination_is_refused(cluster):
    running_with(cluster, {0x10: "0000:00:0a.0"})
    cluster.define("beta", "vm1")
    before = cluster.snapshot()
    line = one_line(cluster.cli(*LIVE))
    assert line == "Error: sim:///beta already has a domain named 'vm1'; remove or rename it first"
    assert cluster.snapshot() == before


@pytest.mark.parametrize(
    ("extra", "wrong"),
    [
        (("--live", "--start"), "--start is for a cold migration; leave out --live or --start"),
        (("--live", "--force"), "--force is for a cold migration"),
        (("--persistent",), "--persistent is for a live migration; add --live or --persistent"),
        (("--migrate-uri", "tcp://127.0.0.1:1"), "--migrate-uri is for a live migration"),
    ],
)
def test_options_of_the_other_kind_are_usage_errors(cluster, extra, wrong):
    cluster.define("gamma", "vm1", [0x10], running=True)
    before = cluster.snapshot()
    r = cluster.cli("migrate", "vm1", "--to", "beta", *extra, *GAMMA)
    assert r.exit_code == 2, r.output
    assert wrong in r.output
    assert cluster.snapshot() == before


def test_a_live_rollback_without_an_interrupted_move_changes_nothing(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    before = cluster.snapshot()
    r = cluster.cli("migrate", "vm1", "--to", "beta", "--live", "--rollback", *GAMMA)
    assert r.exit_code == 1, r.output
    assert one_line(r) == (
        "Error: VM 'vm1' has no interrupted live migration from gamma to roll back; nothing"
        " was changed"
    )
    assert cluster.snapshot() == before


# --- failures converge -----------------------------------------------------------------------


class MigrateFails(SimHypervisor):
    """A source whose live migration is refused by the hypervisor."""

    def migrate_live(self, name, dst, how, switch_over=None):
        raise DomainOperationError("migrate", name, "injected: connection to the peer lost")


def _source(cluster: SimCluster, cls: type[SimHypervisor] = SimHypervisor) -> SimHypervisor:
    hv = cluster.hv("gamma")
    hv.__class__ = cls
    return hv


def run_live(cluster, src=None, dst=None, unplug=True, **kw):
    with cluster.fabric("gamma") as f, cluster.fabric("beta") as g:
        return live_migrate(
            src or cluster.hv("gamma"),
            dst or cluster.hv("beta"),
            f,
            g,
            "vm1",
            "beta",
            how=LiveMigration(**kw),
            state_dir=cluster.state_path.parent,
            unplug=unplug,
        )


def test_failed_migration_plugs_the_devices_back_on_the_source(cluster):
    running_with(cluster, ADDRS)
    before = guest_addresses(cluster.hv("gamma").xml("vm1"))
    with pytest.raises(MigrationError) as e:
        run_live(cluster, src=_source(cluster, MigrateFails))
    assert str(e.value) == (
        "live migration of VM 'vm1' to beta failed: migrate vm1 refused: injected: connection"
        " to the peer lost; it runs on gamma with all its devices, as before"
    )
    gamma = cluster.hv("gamma")
    assert where(cluster) == {"gamma": ("running", True)}
    assert guest_addresses(gamma.xml("vm1")) == before
    assert cluster.holds() == {0x10: "gamma/vm1", 0x12: "gamma/vm1"}
    assert load_journal(cluster.state_path.parent, "vm1") is None


class KeepsSecondDevice(IdleGuest):
    """A guest whose driver will not let go of the hostdev at guest address 00:0b.0."""

    def on_device_removed(self, name: str, device_xml: bytes) -> None:
        if b'slot="0x0b"' in device_xml:
            raise DomainOperationError("detach device from", name, "injected: guest keeps it")


def test_a_device_the_guest_will_not_release_puts_the_others_back(cluster):
    running_with(cluster, ADDRS)
    before = guest_addresses(cluster.hv("gamma").xml("vm1"))
    with pytest.raises(MigrationError) as e:
        run_live(cluster, src=cluster.hv("gamma", guest=KeepsSecondDevice()))
    assert str(e.value).endswith("it runs on gamma with all its devices, as before")
    assert "injected: guest keeps it" in str(e.value)
    assert where(cluster) == {"gamma": ("running", True)}
    assert guest_addresses(cluster.hv("gamma").xml("vm1")) == before  # 0x10 came back
    assert cluster.holds() == {0x10: "gamma/vm1", 0x12: "gamma/vm1"}
    assert load_journal(cluster.state_path.parent, "vm1") is None


class NoHotplugOf12(SimHypervisor):
    """A destination whose hot-plug of device 0x12's hostdev fails."""

    bad: str = ""

    def attach_device(self, name, device_xml, live, config):
        if self.bad and self.bad.encode() in device_xml:
            raise DomainOperationError("attach device to", name, "injected: no free slot")
        return super().attach_device(name, device_xml, live, config)


def test_failed_replug_on_the_destination_names_what_is_missing_and_rerun_finishes(cluster):
    running_with(cluster, ADDRS)
    mdev12 = {f: u for u, f in cluster.mdevs("gamma")}[0x12]
    dst = cluster.hv("beta")
    dst.__class__ = NoHotplugOf12
    dst.bad = mdev12  # type: ignore[attr-defined]
    with pytest.raises(MigrationError) as e:
        run_live(cluster, dst=dst)
    msg = str(e.value)
    assert msg.startswith("VM 'vm1' runs on beta without device(s) 0x12: cannot attach device")
    assert msg.endswith(
        "once that is fixed, run 'vmlend migrate vm1 --to beta --live' again to plug them back"
    )
    assert where(cluster)["beta"] == ("running", False)
    assert cluster.holds() == {0x10: "beta/vm1"}  # 0x12's attach rolled back: nothing held
    assert load_journal(cluster.state_path.parent, "vm1") is not None
    r = cluster.cli(*LIVE)  # the hot-plug works again: the re-run finishes
    assert r.exit_code == 0, r.output
    assert "resuming the interrupted live migration of vm1 to beta" in r.stderr
    assert guest_addresses(cluster.hv("beta").xml("vm1")) == ADDRS
    assert cluster.holds() == {0x10: "beta/vm1", 0x12: "beta/vm1"}
    (rec,) = history(cluster.state_path.parent, "vm1")
    assert rec.resumed and rec.blackout[0x12] is not None


def test_a_rerun_after_the_move_finished_changes_nothing(cluster):
    running_with(cluster, {0x10: "0000:00:0a.0"})
    assert cluster.cli(*LIVE).exit_code == 0
    before = cluster.snapshot()
    r = cluster.cli(*LIVE)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "VM 'vm1' already runs on beta: nothing to do"
    assert cluster.snapshot() == before


def test_interrupted_to_another_destination_is_named(cluster):
    running_with(cluster, {0x10: "0000:00:0a.0"})
    from vmlend.ops.live_state import LiveDevice, LiveJournal, save_journal

    save_journal(
        cluster.state_path.parent,
        LiveJournal("vm1", "", "gamma", "alpha", [LiveDevice(0x10)]),
    )
    before = cluster.snapshot()
    line = one_line(cluster.cli(*LIVE))
    assert line == (
        "Error: a live migration of VM 'vm1' to alpha was interrupted; finish it first:"
        " vmlend migrate vm1 --to alpha --live"
    )
    assert cluster.snapshot() == before


def test_a_damaged_journal_is_reported_not_guessed(cluster):
    running_with(cluster, {0x10: "0000:00:0a.0"})
    from vmlend.ops.live_state import _path

    path = _path(cluster.state_path.parent, "vm1", "pending")
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"{not json")
    line = one_line(cluster.cli(*LIVE))
    assert line.startswith(f"Error: {path} is damaged (")
    assert line.endswith("look at it, then remove it to forget what it records")
    assert hostdev_uuids(cluster.hv("gamma").xml("vm1"))  # the guest still has its device
