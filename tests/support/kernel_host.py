"""The kernel tier's host as an operator sets it up (``Host``, ``operator_host``): the
fabric's state and vmlend's hook installed in the guest's libvirtd; and the etcd leases a
hold is attached to. Shared by the tier's libvirtd and take-back tests."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner, Result

from tests.support.libvirt_daemon import LibvirtDaemon
from vmlend.cli import main
from vmlend.hook.actionlog import log_path_for_state
from vmlend.registry import open_registry, parse_location
from vmlend.registry.etcd_gateway import EtcdGateway
from vmlend.registry.etcd_keys import Keys
from vmlend.wiring.fabric import open_fabric


@dataclass
class Host:
    """This host as an operator sets it up: the fabric's state, vmlend's hook in libvirtd."""

    state: Path
    config: Path
    uri: str
    work: Path
    #: A cluster registry (etcd://...) instead of the SQLite state; the action log stays
    #: beside ``state``.
    registry_url: str | None = None

    @property
    def options(self) -> list[str]:
        """vmlend's global options for this host (the agent's command line takes them too)."""
        base = ["--state", str(self.state), "--config", str(self.config)]
        if self.registry_url is not None:
            base += ["--registry", self.registry_url, "--node", "gamma"]
        return base

    def run(self, *args: str) -> Result:
        """One ``vmlend`` command, whatever its exit code."""
        base = [*self.options, "-c", self.uri]
        return CliRunner().invoke(main, [*base, *args], catch_exceptions=False)

    def vmlend(self, *args: str) -> str:
        """One ``vmlend`` command; its output (it must succeed)."""
        r = self.run(*args)
        assert r.exit_code == 0, (args, r.output)
        return r.output

    def xml_new(self, name: str, *devices: str) -> tuple[Path, str]:
        """``xml new``: the domain's file and the mdev UUID of its first device. A pc
        machine: it hot-plugs into its own PCI bus (ACPI), where q35 needs a free root port,
        and ``xml new --hotplug-slots 1`` leaves none on q35 (libvirt puts its USB controller
        on the port before any device without an address, docs/testing.md)."""
        xml = self.work / f"{name}.xml"
        options = [f"--device={d}" for d in devices]
        self.vmlend(
            "xml", "new", name, "--memory", "64M", "--virt-type", "qemu", "--machine", "pc",
            *options, "-o", str(xml),
        )  # fmt: skip
        return xml, re.findall(r'mdev="([0-9a-f-]+)"', xml.read_text())[0]

    def new_vm(self, name: str, *devices: str) -> str:
        """``xml new`` + ``vm define``: the domain's mdev UUID of its first device."""
        xml, mdev = self.xml_new(name, *devices)
        self.vmlend("vm", "define", str(xml))
        return mdev

    def hook_log(self, vm: str, operation: str) -> list[str]:
        """What the hook recorded for ``vm``'s ``operation`` (its action log, beside the
        state): the messages, in order."""
        path = log_path_for_state(self.state)
        lines = path.read_text().splitlines() if path.exists() else []
        mark = f" vm={vm} {operation}: "
        return [ln.partition(mark)[2] for ln in lines if mark in ln]

    def registry(self) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
        """(fdid, holding VM) of every held device and (uuid, VM) of every mdev record in the
        registry (not the host's own notes of the children it made)."""
        where = self.registry_url or self.state
        with open_fabric(where, "gamma") as fab:
            held = [(d.fdid, d.holder.vm) for d in fab.devices() if d.holder is not None]
        with open_registry(where) as reg, reg.read() as tx:
            records = [(m.uuid, m.vm) for m in tx.mdevs("gamma")]
        return held, records


@contextmanager
def operator_host(
    daemon: LibvirtDaemon, work: Path, registry_url: str | None = None
) -> Iterator[Host]:
    """This host set up with vmlend's hook installed in ``daemon``; what a test left running
    there is destroyed and undefined afterwards. ``registry_url``: a cluster registry."""
    h = Host(work / "state.db", work / "vmlend.toml", daemon.uri, work, registry_url)
    h.config.touch()  # the operator's file: 'hook install' writes what the hook needs into it
    h.vmlend("fabric", "init", "--node", "gamma")
    libvirt_dir = daemon.hooks_dir.parent
    out = json.loads(h.vmlend("hook", "install", "--libvirt-dir", str(libvirt_dir), "--json"))
    assert out["restart_needed"] is False  # the daemon's hooks are enabled: qemu.d is read
    assert (daemon.hooks_dir / "qemu.d" / "vmlend").is_file()
    try:
        yield h
    finally:
        # Also after a failed test (the exception comes out of the yield): stop what it left
        # running before the kernel's children are removed (a child QEMU holds cannot be
        # removed; libvirtd runs the hook, which releases), and undefine its domains, which
        # the next test on the session's daemon would otherwise find.
        conn = daemon.connect()
        try:
            for dom in conn.listAllDomains():
                if dom.isActive():
                    dom.destroy()
                dom.undefine()
        finally:
            conn.close()
        daemon.remove_hook()
        h.vmlend("hook", "uninstall", "--libvirt-dir", str(libvirt_dir))


def hold_leases(url: str, fdid: int) -> list[int]:
    """The etcd leases the hold key of ``fdid`` is attached to."""
    loc = parse_location(url)
    gw = EtcdGateway(loc.endpoints)
    try:
        _rev, kvs = gw.range(Keys(loc.cluster).hold(fdid))
    finally:
        gw.close()
    return [kv.lease for kv in kvs]
