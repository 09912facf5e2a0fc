"""A fenced device taken back through the driver's ``take_back`` (docs/smartio-contract.md §4,
"Taking a device back"; docs/cluster.md, "Fencing"), in the guest, by two ``vmlend agent``
processes on the kernel backend over a private etcd.

This guest is gamma (the stand-in's ``node_id`` 12): its agent holds a lease, and a VM started
through libvirtd holds 0x12, which alpha lends. The borrower's agent is killed (SIGKILL, by its
pid), its lease ends in etcd, and the hold goes with it, leaving the hold's fence. The lender's
side is a second ``vmlend agent``, for node alpha, in the same guest: a host root of its own
(its machine-id, run directory, configuration and state), the same etcd cluster, the same
kernel. The stand-in has one ``node_id`` for the whole guest, but nothing the lender's take-back
does reads it: the agent finds alpha's fenced devices in the registry and writes ``take_back``
for them, which is the path a real lender's agent runs."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.support.etcd_daemon import cluster_name
from tests.support.hostroot import identify
from tests.support.kernel_guest import NODE_ID, REAL, STUB, private_root, write
from tests.support.kernel_host import hold_leases, operator_host
from tests.support.libvirt_daemon import wait_for
from vmlend.hook.actionlog import log_path_for_state
from vmlend.kernel.driver import device_name
from vmlend.kernel.mdev import MdevBus
from vmlend.registry import FenceRecord, parse_location
from vmlend.registry.etcd_gateway import EtcdGateway, prefix_end
from vmlend.registry.etcd_keys import Keys, is_extent, lent_share
from vmlend.wiring.fabric import open_fabric

pytestmark = pytest.mark.libvirtd

FDID = 0x12
#: The borrower's lease: short, so that the test waits seconds for etcd to end it.
BORROWER_TTL = 6
#: What a hold leaves in the registry besides its fence: none of it may outlive the take-back.
HOLD_KEYS = ("holds/", "held-vm/", "units/", "fence/", "mdevs/", "parents/")


def vmlend_exe() -> str:
    return str(Path(sys.executable).parent / "vmlend")


def start_agent(options: list[str], root: Path, ttl: int, log: Path) -> subprocess.Popen[bytes]:
    """``vmlend OPTIONS agent --ttl TTL`` for the host rooted at ``root``, its output in
    ``log``. ``--state`` in ``options`` says where its state is, not ``$VMLEND_STATE``."""
    env = {k: v for k, v in os.environ.items() if k != "VMLEND_STATE"}
    env["VMLEND_ROOT"] = str(root)
    with log.open("wb") as out:
        return subprocess.Popen(
            [vmlend_exe(), *options, "agent", "--ttl", str(ttl), "--interval", "0.2"],
            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def lender_root(base: Path) -> Path:
    """alpha's host root: its own machine-id, the guest's real sys, dev and proc."""
    private_root(base)
    identify(base)
    (base / "vmlend.toml").touch()
    return base


def fences(url: str, node: str) -> list[FenceRecord]:
    """The fences of the devices ``node`` lends, as its agent's scan reads them."""
    with open_fabric(url, node) as fab:
        return fab.fenced()  # type: ignore[attr-defined,no-any-return]


def cluster_keys(url: str) -> list[str]:
    """Every key of the cluster, without its prefix, but a node's extents: unit blocks of
    its own share of its adapter, which its decider keeps for its next VMs (etcd layout 6),
    and a lender's lent entries (layout 7): no hold's."""
    keys = Keys(parse_location(url).cluster)
    gw = EtcdGateway(parse_location(url).endpoints)
    try:
        _rev, kvs = gw.range(keys.base, prefix_end(keys.base))
    finally:
        gw.close()
    return sorted(
        kv.key.removeprefix(keys.base)
        for kv in kvs
        if not is_extent(kv.value) and lent_share(kv.value) is None
    )


def stop(agent: subprocess.Popen[bytes]) -> int:
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
    return agent.wait(60)


def test_a_fenced_device_is_taken_back_by_the_lenders_agent_with_the_fences_token(
    libvirtd, libvirt_conn, tmp_path, fabric_devices, etcd, request, capsys
):
    url = etcd.url(cluster_name(request))
    identify(tmp_path)  # gamma's machine-id (the test's directory is gamma's host root)
    bus = MdevBus(REAL)
    with operator_host(libvirtd, tmp_path, url) as host:
        u1 = host.new_vm("web", f"{FDID:#x}")
        borrower_log = tmp_path / "gamma-agent.log"
        borrower = start_agent(host.options, tmp_path, BORROWER_TTL, borrower_log)
        alpha = lender_root(tmp_path / "alpha")
        lender_log = alpha / "agent.log"
        lender: subprocess.Popen[bytes] | None = None
        try:
            pinned = tomllib.loads(host.config.read_text())["hook-socket"]
            sock = host.work / pinned.lstrip("/")  # as seen inside gamma's root

            def serving() -> bool:
                assert borrower.poll() is None, borrower_log.read_text()
                return sock.is_socket()

            wait_for(serving, 300, f"gamma's agent's socket {sock}", 0.1)
            r = host.run("vm", "start", "web")
            assert r.exit_code == 0, "\n".join(
                [r.output, log_path_for_state(host.state).read_text(), borrower_log.read_text()]
            )
            assert libvirt_conn.lookupByName("web").isActive()
            assert host.registry() == ([(FDID, "web")], [(u1, "web")])
            # The guest enables the device: the driver takes the hardware borrow for this node
            # (the tier's guests run no OS, so the stand-in is told).
            STUB.set_borrower(FDID, NODE_ID)
            token = int(STUB.read(FDID, "token"))  # the hold's: written before the child
            assert token > 0 and int(STUB.read(FDID, "spent")) < token

            # The borrower host dies: its agent, by pid, with no chance to say anything.
            borrower.send_signal(signal.SIGKILL)
            assert borrower.wait(60) == -signal.SIGKILL
            t0 = time.monotonic()
            wait_for(lambda: hold_leases(url, FDID) == [], 120, "the end of gamma's lease", 0.2)
            lapsed = time.monotonic() - t0
            # The hold went with the lease; its fence stays, with the hold's token, and the
            # device is still borrowed in hardware: nothing on gamma gave it back.
            (fence,) = fences(url, "alpha")
            assert (fence.fdid, fence.holder.node, fence.holder.vm) == (FDID, "gamma", "web")
            assert fence.token == token
            assert STUB.read(FDID, "borrower_node_id") == f"{NODE_ID}\n"
            assert not [k for k in cluster_keys(url) if k.startswith("hosts/gamma")]

            # The lender's agent: alpha's, on a host root of its own in this guest.
            t0 = time.monotonic()
            lender = start_agent(
                ["--state", str(alpha / "state.db"), "--config", str(alpha / "vmlend.toml"),
                 "--registry", url, "--node", "alpha"],
                alpha, 60, lender_log,
            )  # fmt: skip

            def taken_back() -> bool:
                assert lender is not None and lender.poll() is None, lender_log.read_text()
                return fences(url, "alpha") == []

            wait_for(taken_back, 300, "alpha's take-back of 0x12", 0.2)
            took = time.monotonic() - t0
            # The driver was given the fence's token: the borrow ended, the token is the
            # device's and spent, so the dead holder's token opens nothing any more.
            assert STUB.read(FDID, "borrower_node_id") == "-1\n"
            assert int(STUB.read(FDID, "token")) == fence.token
            assert int(STUB.read(FDID, "spent")) == fence.token
            with pytest.raises(OSError) as late:
                write(STUB.base / device_name(FDID) / "token", str(fence.token))
            assert late.value.errno == errno.ESTALE
            assert "took back device 0x12 from gamma/web" in lender_log.read_text()
            # Nothing of the hold is left in the registry, the fence included.
            left = [k for k in cluster_keys(url) if k.startswith(HOLD_KEYS)]
            assert left == [], left
            assert host.registry() == ([], [])
            assert stop(lender) == 0, lender_log.read_text()
            assert not [k for k in cluster_keys(url) if k.startswith(HOLD_KEYS)]

            # The VM ran on all along (nothing was left on gamma to pause it). Destroyed now,
            # libvirtd runs the release hook in its own process (no agent): the mdev's record
            # went with gamma's lease, but gamma noted the child it made on the host itself
            # (var/lib/vmlend/made-mdevs), so the release removes it, then the parent.
            dom = libvirt_conn.lookupByName("web")
            assert dom.isActive()
            dom.destroy()
            assert not dom.isActive()
            release = host.hook_log("web", "release")
            assert f"mdev {u1}: removed" in release, release
            assert bus.devices() == []
            assert STUB.registered() == []
            assert host.registry() == ([], [])
            assert not [k for k in cluster_keys(url) if k.startswith(HOLD_KEYS)]
        finally:
            if borrower.poll() is None:
                borrower.send_signal(signal.SIGKILL)
                borrower.wait(60)
            if lender is not None:
                stop(lender)
    with capsys.disabled():
        print(f"\n  gamma's lease ({BORROWER_TTL} s) ended {lapsed:.1f} s after its agent's"
              f" SIGKILL; alpha's agent took 0x12 back {took:.1f} s after its start")  # fmt: skip
