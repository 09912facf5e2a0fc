"""The simulated hypervisor: the qemu hook run as libvirtd runs it, hot-plug, shared state."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lxml import etree

from tests.support.paths import DATA
from vmlend.errors import (
    ConfigError,
    DomainDefinitionError,
    DomainStateError,
    HookFailedError,
    ShutdownTimeoutError,
    UnsupportedOperationError,
)
from vmlend.hypervisor import DomainState
from vmlend.sim.hypervisor.node import IdleGuest, SimHypervisor
from vmlend.wiring.hypervisor import open_hypervisor

DATA = DATA / "hypervisor"
DOMAIN_XML = (DATA / "domain.xml").read_bytes()
MDEV_XML = (DATA / "mdev-hostdev.xml").read_bytes()
MDEV_UUID = "5e0f7d21-3b6a-4c8d-9e1f-223344556677"
HOOK = [shutil.which("sh") or "sh", str(DATA / "recording-hook.sh")]

# What libvirtd passes its qemu hook (docs/hooks.md), libvirt >= 10.5.
START = [["vm1", "prepare", "begin", "-"], ["vm1", "start", "begin", "-"]]
STARTED = [["vm1", "started", "begin", "-"]]


def stop(reason: str) -> list[list[str]]:
    return [["vm1", "stopped", "end", "-"], ["vm1", "release", "end", reason]]


class Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path

    def calls(self) -> list[list[str]]:
        return (
            [ln.split() for ln in self.path.read_text().splitlines()] if self.path.exists() else []
        )

    def stdin(self, n: int) -> etree._Element:
        return etree.fromstring((self.path.parent / f"{self.path.name}.{n}.xml").read_bytes())


@pytest.fixture
def hook(tmp_path, monkeypatch) -> Recorder:
    # The hook learns where to record from the environment libvirtd would pass through.
    log = tmp_path / "hook.log"
    monkeypatch.setenv("HOOK_LOG", str(log))
    monkeypatch.delenv("HOOK_FAIL_AT", raising=False)
    return Recorder(log)


@pytest.fixture
def make(tmp_path):
    def make(**kw) -> SimHypervisor:
        return SimHypervisor("gamma", tmp_path / "hv" / "gamma", HOOK, **kw)

    return make


@pytest.fixture
def sim(make, hook) -> SimHypervisor:
    return make()


def hostdev_uuids(xml: bytes) -> list[str]:
    return etree.fromstring(xml).xpath("devices/hostdev/source/address/@uuid")


# --- the hook -------------------------------------------------------------------------------


def test_start_shutdown_destroy_run_the_hook_in_libvirts_order(sim, hook):
    sim.define(DOMAIN_XML)
    assert hook.calls() == []  # define runs no hook
    sim.start("vm1")
    assert hook.calls() == START + STARTED
    sim.shutdown("vm1", timeout=1)
    sim.start("vm1")
    sim.destroy("vm1")
    sim.undefine("vm1")
    assert hook.calls() == (
        START + STARTED + stop("shutdown") + START + STARTED + stop("destroyed")
    )


def test_hook_gets_the_full_live_domain_xml_on_stdin(sim, hook):
    sim.define(DOMAIN_XML)
    sim.start("vm1")
    for n in (1, 2, 3):
        xml = hook.stdin(n)
        assert xml.findtext("name") == "vm1"
        assert xml.get("id") is not None
        assert xml.xpath("devices/hostdev/source/address/@uuid") == [
            "0b3c2a9e-1d44-4f5e-8c77-aa01b2c3d4e5"
        ]


@pytest.mark.parametrize("failing", ["prepare", "start"])
def test_failing_hook_aborts_the_start_and_still_runs_stopped_and_release(
    sim, hook, monkeypatch, failing
):
    sim.define(DOMAIN_XML)
    monkeypatch.setenv("HOOK_FAIL_AT", failing)
    with pytest.raises(HookFailedError, match=f"refusing {failing} of vm1") as exc:
        sim.start("vm1")
    assert "\n" not in str(exc.value)
    upto = START[: START.index(["vm1", failing, "begin", "-"]) + 1]
    assert hook.calls() == upto + stop("failed")
    assert sim.lookup("vm1").state is DomainState.SHUTOFF


def test_failing_started_hook_stops_the_domain_again(sim, hook, monkeypatch):
    sim.define(DOMAIN_XML)
    monkeypatch.setenv("HOOK_FAIL_AT", "started")
    with pytest.raises(HookFailedError):
        sim.start("vm1")
    assert hook.calls() == START + STARTED + stop("failed")
    assert sim.lookup("vm1").state is DomainState.SHUTOFF


def test_a_failed_start_says_one_thing_even_when_its_stop_hooks_fail_too(tmp_path, hook, caplog):
    """After a failed prepare libvirt runs stopped and release, which may fail as well (the
    agent serving the hook died). Their failures are libvirtd's log, not a second line next
    to the start's own error (the CLI prints every warning on stderr)."""
    failing = tmp_path / "failing-hook.sh"
    failing.write_text('cat >/dev/null; echo "hook: refusing $2 of $1" >&2; exit 1\n')
    sim = SimHypervisor(
        "gamma", tmp_path / "hv" / "gamma", [shutil.which("sh") or "sh", str(failing)]
    )
    sim.define(DOMAIN_XML)
    caplog.set_level("INFO")
    with pytest.raises(HookFailedError, match="refusing prepare of vm1"):
        sim.start("vm1")
    assert [r.levelname for r in caplog.records if "refusing" in r.getMessage()] == ["INFO"] * 2
    assert "refusing stopped" in caplog.text and "refusing release" in caplog.text


@pytest.mark.parametrize("how", ["destroy", "failed started hook"])
def test_the_stop_hooks_run_once_qemu_is_gone(tmp_path, hook, monkeypatch, how):
    """libvirt runs 'stopped' and 'release' after the QEMU process ended: a reader of the
    node's files (a checker of which VMs run) must not see the domain live while they run."""
    live = tmp_path / "hv" / "gamma" / "live" / "vm1.xml"
    seen = tmp_path / "seen"
    script = tmp_path / "hook.sh"
    script.write_text(
        'cat >/dev/null; if [ "$2" = started ] && [ -n "${FAIL_STARTED:-}" ]; then exit 1; fi\n'
        f'case "$2" in stopped|release) [ -e {live} ] && echo "$2 live" >> {seen};; esac\n'
        "exit 0\n"
    )
    sim = SimHypervisor(
        "gamma", tmp_path / "hv" / "gamma", [shutil.which("sh") or "sh", str(script)]
    )
    sim.define(DOMAIN_XML)
    if how == "destroy":
        sim.start("vm1")
        assert live.exists()
        sim.destroy("vm1")
    else:
        monkeypatch.setenv("FAIL_STARTED", "1")
        with pytest.raises(HookFailedError):
            sim.start("vm1")
    assert not seen.exists(), seen.read_text()
    assert sim.lookup("vm1").state is DomainState.SHUTOFF


@pytest.mark.parametrize("failing", ["stopped", "release"])
def test_stop_hook_failures_are_ignored(sim, hook, monkeypatch, failing, caplog):
    sim.define(DOMAIN_XML)
    sim.start("vm1")
    monkeypatch.setenv("HOOK_FAIL_AT", failing)
    sim.destroy("vm1")
    assert sim.lookup("vm1").state is DomainState.SHUTOFF
    assert hook.calls()[-2:] == stop("destroyed")
    assert f"refusing {failing}" in caplog.text


def test_release_reason_dash_like_libvirt_9(make, hook):
    sim = make(release_reasons=False)
    sim.define(DOMAIN_XML)
    sim.start("vm1")
    sim.destroy("vm1")
    assert hook.calls()[-1] == ["vm1", "release", "end", "-"]


def test_missing_hook_program_fails_the_start(tmp_path, hook):
    sim = SimHypervisor("gamma", tmp_path / "hv", [str(tmp_path / "no-such-hook")])
    sim.define(DOMAIN_XML)
    with pytest.raises(HookFailedError, match="cannot run hook"):
        sim.start("vm1")
    assert sim.lookup("vm1").state is DomainState.SHUTOFF


def test_no_hook_command_runs_no_hook(tmp_path, hook):
    sim = SimHypervisor("gamma", tmp_path / "hv", None)
    sim.define(DOMAIN_XML)
    sim.start("vm1")
    sim.destroy("vm1")
    assert hook.calls() == []


# --- hot-plug --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("live", "config", "in_live", "in_config"),
    [
        (True, False, True, False),
        (False, True, False, True),
        (True, True, True, True),
        (False, False, True, False),
    ],  # neither flag: "current", i.e. live on a running domain
)
def test_attach_and_detach_change_the_xml_the_flags_name(
    sim, hook, live, config, in_live, in_config
):
    sim.define(DOMAIN_XML)
    sim.start("vm1")
    sim.attach_device("vm1", MDEV_XML, live=live, config=config)
    assert (MDEV_UUID in hostdev_uuids(sim.xml("vm1"))) is in_live
    assert (MDEV_UUID in hostdev_uuids(sim.xml("vm1", inactive=True))) is in_config
    sim.detach_device("vm1", MDEV_XML, live=live, config=config)
    assert MDEV_UUID not in hostdev_uuids(sim.xml("vm1"))
    assert MDEV_UUID not in hostdev_uuids(sim.xml("vm1", inactive=True))
    assert hook.calls() == START + STARTED  # libvirt has no hook for hot-plug


def test_attached_mdev_gets_libvirts_defaults(sim):
    sim.define(DOMAIN_XML)
    sim.attach_device("vm1", MDEV_XML, live=False, config=True)
    added = etree.fromstring(sim.xml("vm1")).xpath(
        f"devices/hostdev[source/address/@uuid='{MDEV_UUID}']"
    )[0]
    assert (added.get("managed"), added.get("display")) == ("no", "off")


def test_config_attach_on_a_stopped_domain_is_used_at_next_start(sim):
    sim.define(DOMAIN_XML)
    sim.attach_device("vm1", MDEV_XML, live=False, config=True)
    sim.start("vm1")
    assert MDEV_UUID in hostdev_uuids(sim.xml("vm1"))


def test_live_attach_on_a_stopped_domain_is_refused(sim):
    sim.define(DOMAIN_XML)
    with pytest.raises(DomainStateError, match="not running"):
        sim.attach_device("vm1", MDEV_XML, live=True, config=False)
    assert MDEV_UUID not in hostdev_uuids(sim.xml("vm1"))


def test_attach_twice_and_detach_absent_are_refused(sim):
    sim.define(DOMAIN_XML)
    sim.attach_device("vm1", MDEV_XML, live=False, config=True)
    with pytest.raises(DomainStateError, match="already in the domain"):
        sim.attach_device("vm1", MDEV_XML, live=False, config=True)
    sim.detach_device("vm1", MDEV_XML, live=False, config=True)
    with pytest.raises(DomainStateError, match="not present"):
        sim.detach_device("vm1", MDEV_XML, live=False, config=True)


def test_config_attach_on_a_transient_domain_is_refused(sim):
    sim.define(DOMAIN_XML)
    sim.start("vm1")
    sim.undefine("vm1")
    with pytest.raises(DomainStateError, match="transient"):
        sim.attach_device("vm1", MDEV_XML, live=False, config=True)


@pytest.mark.parametrize(
    ("xml", "error"),
    [
        (b"<disk type='file'/>", UnsupportedOperationError),
        (b"<hostdev mode='subsystem' type='mdev'><source/></hostdev>", DomainDefinitionError),
        (b"<hostdev", DomainDefinitionError),
    ],
)
def test_bad_device_xml_is_refused(sim, xml, error):
    sim.define(DOMAIN_XML)
    before = sim.xml("vm1")
    with pytest.raises(error):
        sim.attach_device("vm1", xml, live=False, config=True)
    assert sim.xml("vm1") == before


# --- the simulated guest -------------------------------------------------------------------


class RecordingGuest(IdleGuest):
    def __init__(self, obey_shutdown: bool = True, refuse_add: bool = False) -> None:
        self.events: list[tuple[str, ...]] = []
        self.obey = obey_shutdown
        self.refuse_add = refuse_add

    def on_started(self, name, domain_xml):
        self.events.append(("started", name, etree.fromstring(domain_xml).get("id")))

    def on_device_added(self, name, device_xml):
        if self.refuse_add:
            raise UnsupportedOperationError("attach device to", name, "guest said no")
        self.events.append(
            ("added", name, hostdev_uuids(b"<d><devices>%s</devices></d>" % device_xml)[0])
        )

    def on_device_removed(self, name, device_xml):
        self.events.append(
            ("removed", name, hostdev_uuids(b"<d><devices>%s</devices></d>" % device_xml)[0])
        )

    def on_shutdown_request(self, name):
        return self.obey

    def on_stopped(self, name):
        self.events.append(("stopped", name))


def test_guest_driver_sees_start_hotplug_and_stop(make, hook):
    guest = RecordingGuest()
    sim = make(guest_driver=guest)
    sim.define(DOMAIN_XML)
    sim.attach_device("vm1", MDEV_XML, live=False, config=True)  # not live: guest sees nothing
    sim.detach_device("vm1", MDEV_XML, live=False, config=True)
    sim.start("vm1")
    sim.attach_device("vm1", MDEV_XML, live=True, config=False)
    sim.detach_device("vm1", MDEV_XML, live=True, config=False)
    sim.shutdown("vm1", timeout=1)
    assert [e[0] for e in guest.events] == ["started", "added", "removed", "stopped"]
    assert guest.events[1] == ("added", "vm1", MDEV_UUID)


def test_guest_ignoring_acpi_makes_shutdown_time_out(make, hook):
    sim = make(guest_driver=RecordingGuest(obey_shutdown=False))
    sim.define(DOMAIN_XML)
    sim.start("vm1")
    with pytest.raises(ShutdownTimeoutError, match="destroy"):
        sim.shutdown("vm1", timeout=5)
    assert sim.lookup("vm1").state is DomainState.RUNNING
    sim.destroy("vm1")
    assert sim.lookup("vm1").state is DomainState.SHUTOFF


def test_guest_refusing_a_device_leaves_the_domain_unchanged(make, hook):
    sim = make(guest_driver=RecordingGuest(refuse_add=True))
    sim.define(DOMAIN_XML)
    sim.start("vm1")
    with pytest.raises(UnsupportedOperationError, match="guest said no"):
        sim.attach_device("vm1", MDEV_XML, live=True, config=True)
    assert MDEV_UUID not in hostdev_uuids(sim.xml("vm1"))
    assert MDEV_UUID not in hostdev_uuids(sim.xml("vm1", inactive=True))


# --- state shared between processes; opening ------------------------------------------------


def test_a_second_instance_sees_the_same_domains(make, hook):
    first = make()
    first.define(DOMAIN_XML)
    first.start("vm1")
    first.attach_device("vm1", MDEV_XML, live=True, config=False)
    second = make()
    assert second.lookup("vm1").state is DomainState.RUNNING
    assert MDEV_UUID in hostdev_uuids(second.xml("vm1"))
    second.destroy("vm1")
    assert first.lookup("vm1").state is DomainState.SHUTOFF


def test_domain_ids_increase_across_starts(sim):
    sim.define(DOMAIN_XML)
    ids = []
    for _ in range(2):
        sim.start("vm1")
        ids.append(int(etree.fromstring(sim.xml("vm1")).get("id")))
        sim.destroy("vm1")
    assert ids[1] > ids[0]


def test_name_with_slash_is_refused(sim):
    root = etree.fromstring(DOMAIN_XML)
    root.find("name").text = "../evil"
    with pytest.raises(DomainDefinitionError, match="cannot contain '/'"):
        sim.define(etree.tostring(root))


def test_open_sim_uri_puts_node_state_under_state_dir(tmp_path, hook):
    hv = open_hypervisor("sim:///beta", state_dir=tmp_path, hook_command=HOOK)
    assert (hv.uri, hv.node) == ("sim:///beta", "beta")
    hv.define(DOMAIN_XML)
    assert (tmp_path / "hv" / "beta" / "config" / "vm1.xml").is_file()
    other = open_hypervisor("sim:///alpha", state_dir=tmp_path, hook_command=HOOK)
    assert other.list_domains() == []


def test_default_uri_comes_from_the_environment(tmp_path):
    hv = open_hypervisor(
        None, state_dir=tmp_path, hook_command=None, env={"LIBVIRT_DEFAULT_URI": "sim:///gamma"}
    )
    assert hv.node == "gamma"


@pytest.mark.parametrize("uri", ["sim:///", "sim:///a/b", "sim:///.hidden"])
def test_bad_sim_uri(tmp_path, uri):
    with pytest.raises(ConfigError, match="sim:///<node>"):
        open_hypervisor(uri, state_dir=tmp_path, hook_command=None)


def test_node_must_match_the_sim_uri(tmp_path):
    assert open_hypervisor("sim:///beta", state_dir=tmp_path, hook_command=None, node="beta")
    with pytest.raises(ConfigError, match="'alpha' does not match"):
        open_hypervisor("sim:///beta", state_dir=tmp_path, hook_command=None, node="alpha")


def test_racing_starts_from_two_processes_start_the_domain_once(make, hook, tmp_path):
    make().define(DOMAIN_XML)
    code = (
        "import sys; from pathlib import Path\n"
        "from vmlend.errors import DomainStateError\n"
        "from vmlend.sim.hypervisor.node import SimHypervisor\n"
        f"hv = SimHypervisor('gamma', Path({str(tmp_path / 'hv' / 'gamma')!r}), {HOOK!r})\n"
        "try:\n    hv.start('vm1')\nexcept DomainStateError:\n    sys.exit(3)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    assert sorted(p.wait(timeout=30) for p in procs) == [0, 3]
    assert hook.calls() == START + STARTED  # the hook ran for one start only


# --- live migration -------------------------------------------------------------------------


MIGRATE_IN = [["vm1", "migrate", "begin", "-"], *START, *STARTED]


@pytest.fixture
def beta(tmp_path) -> SimHypervisor:
    return SimHypervisor("beta", tmp_path / "hv" / "beta", HOOK)


def test_live_migration_runs_the_destinations_hooks_then_the_sources_stop_hooks(sim, beta, hook):
    from vmlend.hypervisor import LiveMigration

    sim.define(DOMAIN_XML)
    sim.start("vm1")
    before = len(hook.calls())
    stats = sim.migrate_live("vm1", beta, LiveMigration())
    assert hook.calls()[before:] == MIGRATE_IN + stop("migrated")
    assert stats.downtime is not None and stats.downtime >= 0
    assert beta.lookup("vm1").state is DomainState.RUNNING
    assert not beta.lookup("vm1").persistent  # without --persistent: transient there
    assert sim.lookup("vm1").state is DomainState.SHUTOFF  # still defined here
    assert hostdev_uuids(beta.xml("vm1")) == hostdev_uuids(DOMAIN_XML)


def test_persistent_undefine_source_moves_the_definition(sim, beta, hook):
    from vmlend.hypervisor import LiveMigration

    sim.define(DOMAIN_XML)
    sim.start("vm1")
    sim.migrate_live("vm1", beta, LiveMigration(persistent=True, undefine_source=True))
    assert beta.lookup("vm1").persistent and beta.lookup("vm1").active
    assert sim.list_domains() == []


@pytest.mark.parametrize("failing", ["migrate", "prepare", "start", "started"])
def test_a_refusing_destination_hook_cancels_the_migration(sim, beta, hook, monkeypatch, failing):
    from vmlend.hypervisor import LiveMigration

    sim.define(DOMAIN_XML)
    sim.start("vm1")
    monkeypatch.setenv("HOOK_FAIL_AT", failing)
    with pytest.raises(HookFailedError, match=f"refusing {failing} of vm1"):
        sim.migrate_live("vm1", beta, LiveMigration(persistent=True, undefine_source=True))
    assert sim.lookup("vm1").state is DomainState.RUNNING and sim.lookup("vm1").persistent
    assert beta.list_domains() == []


def test_migrating_a_stopped_domain_or_to_itself_is_refused(sim, beta, make, hook):
    from vmlend.hypervisor import LiveMigration

    sim.define(DOMAIN_XML)
    with pytest.raises(DomainStateError, match="domain is not running"):
        sim.migrate_live("vm1", beta, LiveMigration())
    sim.start("vm1")
    with pytest.raises(DomainStateError, match="the destination is this node"):
        sim.migrate_live("vm1", make(), LiveMigration())
    assert beta.list_domains() == [] and sim.lookup("vm1").active


def test_another_domain_of_that_name_on_the_destination_is_refused(sim, beta, hook):
    from vmlend.hypervisor import LiveMigration

    sim.define(DOMAIN_XML)
    sim.start("vm1")
    root = etree.fromstring(DOMAIN_XML)
    root.find("uuid").text = "11111111-2222-4333-8444-555555555555"
    beta.define(etree.tostring(root))
    with pytest.raises(DomainDefinitionError, match="another domain named 'vm1'"):
        sim.migrate_live("vm1", beta, LiveMigration())
    assert sim.lookup("vm1").active and not beta.lookup("vm1").active


def test_a_hook_that_hangs_holds_up_its_own_domain_only(tmp_path):
    """libvirt runs a hook with its domain object locked, not the whole driver: while one
    domain's prepare hangs (waiting for an etcd without quorum), another domain is looked up,
    read and paused. Found by the nemesis test: the simulator's one lock made the agent's pause
    of a running VM wait for another VM's start, and the VM ran on past its lease."""
    import threading

    holding, go = tmp_path / "holding", tmp_path / "go"
    script = tmp_path / "hook.sh"
    script.write_text(
        "cat >/dev/null\n"
        f'if [ "$1 $2" = "vm2 prepare" ]; then touch {holding};'
        f" while [ ! -e {go} ]; do sleep 0.01; done; fi\n"
        "exit 0\n"
    )
    sim = SimHypervisor(
        "gamma", tmp_path / "hv" / "gamma", [shutil.which("sh") or "sh", str(script)]
    )
    sim.define(DOMAIN_XML)
    second = etree.fromstring(DOMAIN_XML)
    second.find("name").text = "vm2"
    second.find("uuid").text = "0b0b0b0b-0000-4000-8000-000000000002"
    sim.define(etree.tostring(second))
    sim.start("vm1")
    starting = threading.Thread(target=sim.start, args=("vm2",))
    starting.start()
    try:
        while not holding.exists():
            assert starting.is_alive()
            threading.Event().wait(0.01)
        sim.suspend("vm1")  # before the hook of vm2 is let go
        assert sim.lookup("vm1").state is DomainState.PAUSED
        assert b"<name>vm1</name>" in sim.xml("vm1")
        assert not go.exists()
    finally:
        go.touch()
        starting.join()
    assert sim.lookup("vm2").state is DomainState.RUNNING
