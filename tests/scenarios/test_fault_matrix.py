"""``kill -9`` at every named step of attach, detach, migrate (cold and live) and the hook's
prepare/release, then recovery with the tool itself: re-run the command (or ``vmlend reconcile
--fix``). The end state must be consistent — ``reconcile`` finds no drift — and no device is
held by a VM that does not use it. The matrix (operation x point -> recovery) is in docs/testing.md.

The CLI runs as a subprocess with ``VMLEND_FAULT`` naming the point (vmlend/faults.py); the
simulated hypervisor runs the hook as a subprocess too, so hook points die the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cli_cluster import GAMMA, SimCluster
from tests.support.handover_checks import registry_violations
from tests.support.killed_cli import assert_killed, run_cli
from tests.support.live_moves import holds
from vmlend.domain import read_domain
from vmlend.errors import HookFailedError
from vmlend.faults import FAULT_ENV, POINTS
from vmlend.topology.model import MiB

#: Every case kills or freezes a process at a named point.
pytestmark = pytest.mark.daemon

_run = run_cli
_killed = assert_killed


def _consistent(cluster: SimCluster) -> None:
    """No drift on any node, and every hold is of a running VM whose live XML names it."""
    for node in ("gamma", "alpha"):
        res = _run(cluster.state_path, "reconcile", "-c", f"sim:///{node}", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["drift"] == [], (node, res.stdout)
    with cluster.fabric() as f:
        holds = [(st.fdid, st.holder) for st in f.devices() if st.holder]
    for fdid, holder in holds:
        assert holder is not None
        hv = cluster.hv(holder.node)
        info = hv.lookup(holder.vm)
        assert info.active, f"{fdid:#x} held by {holder}, which is not running"
        assert fdid in {d.fdid for d in read_domain(hv.xml(holder.vm)).devices}


@pytest.mark.parametrize("point", POINTS["attach"])
def test_attach_killed_then_rerun(cluster, point):
    cluster.define("gamma", "vm1", [0x11], running=True)
    _killed(_run(cluster.state_path, "attach", "vm1", "0x10", *GAMMA, fault=f"attach:{point}"))
    res = _run(cluster.state_path, "attach", "vm1", "0x10", *GAMMA)
    assert res.returncode == 0, res.stderr
    _consistent(cluster)
    assert cluster.holds() == {0x10: "gamma/vm1", 0x11: "gamma/vm1"}


@pytest.mark.parametrize("point", POINTS["detach"])
def test_detach_killed_then_rerun(cluster, point):
    cluster.define("gamma", "vm1", [0x10, 0x11], running=True)
    _killed(_run(cluster.state_path, "detach", "vm1", "0x10", *GAMMA, fault=f"detach:{point}"))
    res = _run(cluster.state_path, "detach", "vm1", "0x10", *GAMMA)
    assert res.returncode == 0, res.stderr
    _consistent(cluster)
    assert cluster.holds() == {0x11: "gamma/vm1"}


@pytest.mark.parametrize("point", POINTS["migrate"])
def test_migrate_killed_then_rerun(cluster, point):
    cluster.define("gamma", "vm1", [0x10], running=True, memory=256 * MiB)
    args = ("migrate", "vm1", "--to", "alpha", "--start", *GAMMA)
    _killed(_run(cluster.state_path, *args, fault=f"migrate:{point}"))
    res = _run(cluster.state_path, *args)
    assert res.returncode == 0, res.stderr
    _consistent(cluster)
    assert cluster.hv("alpha").lookup("vm1").active
    assert [d.name for d in cluster.hv("gamma").list_domains()] == []
    assert cluster.holds() == {0x10: "alpha/vm1"}


#: Where a live migration can die: its own step boundaries, and those of the detach it runs on
#: the source and the attach it runs on the destination.
LIVE_POINTS = [
    *(f"live-migrate:{p}" for p in POINTS["live-migrate"]),
    *(f"detach:{p}" for p in POINTS["detach"]),
    *(f"attach:{p}" for p in POINTS["attach"]),
]


@pytest.mark.parametrize("fault", LIVE_POINTS)
def test_live_migrate_killed_then_rerun(cluster, fault):
    cluster.define("gamma", "vm1", running=True, memory=256 * MiB)
    for fdid, address in ((0x10, "0000:00:0a.0"), (0x11, "0000:00:0b.0")):
        attach = ("attach", "vm1", hex(fdid), "--address", address, "--live", "--config")
        assert _run(cluster.state_path, *attach, *GAMMA).returncode == 0
    args = (
        *("migrate", "vm1", "--to", "alpha", "--live", "--unplug"),
        *("--persistent", "--undefinesource", *GAMMA),
    )
    _killed(_run(cluster.state_path, *args, fault=fault))
    res = _run(cluster.state_path, *args)
    assert res.returncode == 0, res.stderr
    _consistent(cluster)
    alpha = cluster.hv("alpha")
    assert alpha.lookup("vm1").active and alpha.lookup("vm1").persistent
    assert [d.name for d in cluster.hv("gamma").list_domains()] == []
    assert cluster.holds() == {0x10: "alpha/vm1", 0x11: "alpha/vm1"}
    live = read_domain(alpha.xml("vm1"))
    assert {d.fdid: str(d.address) for d in live.devices} == {
        0x10: "0000:00:0a.0",
        0x11: "0000:00:0b.0",
    }
    status = json.loads(
        _run(cluster.state_path, "status", "vm1", "-c", "sim:///alpha", "--json").stdout
    )
    (record,) = status["vms"][0]["live_migrations"]
    assert record["resumed"] is True and set(record["blackout"]) == {"0x10", "0x11"}


@pytest.mark.parametrize("point", POINTS["hot-migrate"])
def test_hot_migrate_killed_then_rerun(cluster, point):
    """Killed after the destination's room is claimed, inside the switch-over after the holds
    moved, or after the move: the same command finishes, the devices never left the guest."""
    cluster.define("gamma", "vm1", running=True, memory=256 * MiB)
    for fdid, address in ((0x10, "0000:00:0a.0"), (0x11, "0000:00:0b.0")):
        attach = ("attach", "vm1", hex(fdid), "--address", address, "--live", "--config")
        assert _run(cluster.state_path, *attach, *GAMMA).returncode == 0
    args = ("migrate", "vm1", "--to", "alpha", "--live", "--persistent", "--undefinesource", *GAMMA)
    _killed(_run(cluster.state_path, *args, fault=f"hot-migrate:{point}"))
    res = _run(cluster.state_path, *args)
    assert res.returncode == 0, res.stderr
    assert "unplugging" not in res.stderr
    _consistent(cluster)
    alpha = cluster.hv("alpha")
    assert alpha.lookup("vm1").active and alpha.lookup("vm1").persistent
    assert [d.name for d in cluster.hv("gamma").list_domains()] == []
    assert cluster.holds() == {0x10: "alpha/vm1", 0x11: "alpha/vm1"}
    with cluster.fabric() as f:
        assert registry_violations(f.registry) == []  # no room left claimed on gamma
    status = json.loads(
        _run(cluster.state_path, "status", "vm1", "-c", "sim:///alpha", "--json").stdout
    )
    (record,) = status["vms"][0]["live_migrations"]
    assert record["mode"] == "hot" and record["resumed"] is True


def _nothing_on_alpha(cluster: SimCluster) -> None:
    """No claim, mdev or hand-over record of vm1 is left for alpha."""
    with cluster.fabric() as f, f.registry.read() as tx:
        claims = [c for _f, c in tx.claims() if "alpha/vm1" in c.share]
        mdevs = [m for m in tx.mdevs() if m.node == "alpha" and m.vm == "vm1"]
        records = tx.runtime(kind="hand-over")
    assert (claims, mdevs, records) == ([], [], [])
    with cluster.fabric() as f:
        assert registry_violations(f.registry) == []
    alpha = [d.name for d in cluster.hv("alpha").list_domains() if d.active]
    assert alpha == []


def _rolled_back(cluster: SimCluster, args: tuple[str, ...], before: dict) -> dict:
    """Roll the killed move back (``_check_rolled_back``)."""
    return _check_rolled_back(cluster, _run(cluster.state_path, *args, "--rollback"), before)


def _check_rolled_back(
    cluster: SimCluster, res: subprocess.CompletedProcess[str], before: dict
) -> dict:
    """The rollback ``res`` succeeded: the VM runs on gamma with its devices at their
    addresses, each hold gamma's again, its token never older; nothing is left for alpha."""
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("rolled back the live migrate of VM 'vm1': it runs on gamma")
    _consistent(cluster)
    gamma = cluster.hv("gamma")
    assert gamma.lookup("vm1").active and gamma.lookup("vm1").persistent
    after = holds(cluster)
    assert {f: h for f, (h, _t) in after.items()} == {0x10: "gamma/vm1", 0x11: "gamma/vm1"}
    assert all(after[f][1] >= before[f][1] for f in after)
    live = read_domain(gamma.xml("vm1"))
    assert {d.fdid: str(d.address) for d in live.devices} == {
        0x10: "0000:00:0a.0",
        0x11: "0000:00:0b.0",
    }
    _nothing_on_alpha(cluster)
    return after


@pytest.mark.parametrize("fault", LIVE_POINTS)
def test_live_migrate_killed_then_rolled_back(cluster, fault):
    cluster.define("gamma", "vm1", running=True, memory=256 * MiB)
    for fdid, address in ((0x10, "0000:00:0a.0"), (0x11, "0000:00:0b.0")):
        attach = ("attach", "vm1", hex(fdid), "--address", address, "--live", "--config")
        assert _run(cluster.state_path, *attach, *GAMMA).returncode == 0
    before = holds(cluster)
    args = (
        *("migrate", "vm1", "--to", "alpha", "--live", "--unplug"),
        *("--persistent", "--undefinesource", *GAMMA),
    )
    _killed(_run(cluster.state_path, *args, fault=fault))
    after = _rolled_back(cluster, args, before)
    # the first device was unplugged before any kill point: its hold is a new one
    assert after[0x10][1] > before[0x10][1]


@pytest.mark.parametrize("point", POINTS["hot-migrate"])
def test_hot_migrate_killed_then_rolled_back(cluster, point):
    """After the claim the holds never moved (same tokens); after the hand-over they come
    back under newer ones."""
    cluster.define("gamma", "vm1", running=True, memory=256 * MiB)
    for fdid, address in ((0x10, "0000:00:0a.0"), (0x11, "0000:00:0b.0")):
        attach = ("attach", "vm1", hex(fdid), "--address", address, "--live", "--config")
        assert _run(cluster.state_path, *attach, *GAMMA).returncode == 0
    before = holds(cluster)
    args = ("migrate", "vm1", "--to", "alpha", "--live", "--persistent", "--undefinesource", *GAMMA)
    _killed(_run(cluster.state_path, *args, fault=f"hot-migrate:{point}"))
    after = _rolled_back(cluster, args, before)
    if point == "after-claim":
        assert after == before
    else:
        assert all(after[f][1] > before[f][1] for f in after)


def test_a_rollback_killed_after_its_hand_back_re_points_when_run_again(cluster):
    """The hand-back commits before the lenders are re-pointed: a rollback killed between
    the two leaves the registry the source's and the lenders serving the destination. Run
    again, it re-points them with the source's newer tokens (before, it took the holds being
    the source's for a move never handed over, released the room and re-pointed nothing)."""
    cluster.define("gamma", "vm1", running=True, memory=256 * MiB)
    for fdid, address in ((0x10, "0000:00:0a.0"), (0x11, "0000:00:0b.0")):
        attach = ("attach", "vm1", hex(fdid), "--address", address, "--live", "--config")
        assert _run(cluster.state_path, *attach, *GAMMA).returncode == 0
    before = holds(cluster)
    args = ("migrate", "vm1", "--to", "alpha", "--live", "--persistent", "--undefinesource", *GAMMA)
    _killed(_run(cluster.state_path, *args, fault="hot-migrate:after-hand-over"))
    _killed(_run(cluster.state_path, *args, "--rollback", fault="live-rollback:after-hand-back"))
    handed_back = holds(cluster)
    assert all(handed_back[f][1] > before[f][1] for f in handed_back)
    res = _run(cluster.state_path, *args, "--rollback")
    assert "handed back to gamma (0x10 token" in res.stderr, res.stderr
    assert "room claimed" not in res.stderr
    assert _check_rolled_back(cluster, res, before) == handed_back


def test_prepare_killed_is_cleaned_up_by_the_release_hook(cluster, monkeypatch):
    # libvirt runs the release hook after a failed start (so does the simulated node): the
    # first device, reserved before the kill, is returned there; nothing is left for reconcile.
    cluster.define("gamma", "vm1", [0x10, 0x11])
    monkeypatch.setenv(FAULT_ENV, "prepare:after-device")
    hv = cluster.hv("gamma")
    with pytest.raises(HookFailedError):
        hv.start("vm1")
    monkeypatch.delenv(FAULT_ENV)
    assert not hv.lookup("vm1").active
    _consistent(cluster)
    assert cluster.holds() == {} and cluster.mdevs() == set()
    hv.start("vm1")  # and the VM starts normally afterwards
    assert cluster.holds() == {0x10: "gamma/vm1", 0x11: "gamma/vm1"}


def test_release_killed_then_reconcile_fix(cluster, monkeypatch):
    cluster.define("gamma", "vm1", [0x10, 0x11], running=True)
    monkeypatch.setenv(FAULT_ENV, "release:after-mdevs")
    hv = cluster.hv("gamma")
    hv.destroy("vm1")  # libvirt only logs a failed release hook: the VM stops anyway
    monkeypatch.delenv(FAULT_ENV)
    assert not hv.lookup("vm1").active
    found = json.loads(_run(cluster.state_path, "reconcile", *GAMMA, "--json").stdout)
    assert {d["kind"] for d in found["drift"]} == {"hold-of-stopped-vm"}
    res = _run(cluster.state_path, "reconcile", *GAMMA, "--fix")
    assert res.returncode == 0, res.stderr
    _consistent(cluster)
    assert cluster.holds() == {}


# --- migrate: roll back instead, and two migrates at once ------------------------------------


@pytest.mark.parametrize("point", ["after-define", "after-undefine"])
def test_interrupted_migrate_rolls_back(cluster, point):
    cluster.define("gamma", "vm1", [0x10], running=True, memory=256 * MiB)
    args = ("migrate", "vm1", "--to", "alpha", *GAMMA)
    _killed(_run(cluster.state_path, *args, fault=f"migrate:{point}"))
    res = _run(cluster.state_path, *args, "--rollback")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "rolled back the migrate of VM 'vm1': it is defined on gamma only\n"
    assert [d.name for d in cluster.hv("alpha").list_domains()] == []
    gamma = cluster.hv("gamma")
    assert read_domain(gamma.xml("vm1", inactive=True)).host_node in (None, "gamma")
    gamma.start("vm1")
    _consistent(cluster)
    assert cluster.holds() == {0x10: "gamma/vm1"}


def test_rollback_without_an_interrupted_migrate_is_refused(cluster):
    cluster.define("gamma", "vm1", [0x10])
    before = cluster.snapshot()
    res = _run(cluster.state_path, "migrate", "vm1", "--to", "alpha", *GAMMA, "--rollback")
    assert res.returncode == 1
    assert res.stderr == (
        "Error: VM 'vm1' is defined on gamma only: there is no interrupted migration to roll back\n"
    )
    assert cluster.snapshot() == before


def test_a_second_migrate_of_the_same_vm_reports_the_truth(cluster):
    from vmlend.ops.migrate import migration_lock

    cluster.define("gamma", "vm1", [0x10])
    before = cluster.snapshot()
    with migration_lock(cluster.state_path.parent, "vm1"):  # the first migrate, still running
        res = _run(cluster.state_path, "migrate", "vm1", "--to", "alpha", *GAMMA)
    assert res.returncode == 1
    assert res.stderr == (
        "Error: VM 'vm1' is being migrated by another vmlend process right now; wait for it to"
        " finish, then see where the VM is with 'vmlend status'\n"
    )
    assert cluster.snapshot() == before
    # The first one finished; a late second one finds the VM moved and says so.
    assert _run(cluster.state_path, "migrate", "vm1", "--to", "alpha", *GAMMA).returncode == 0
    late = _run(cluster.state_path, "migrate", "vm1", "--to", "alpha", *GAMMA, "--json")
    assert late.returncode == 0, late.stderr
    assert json.loads(late.stdout)["resumed"] is True
    assert "already defined on alpha only: the move was done" in late.stderr


# --- Ctrl-C ----------------------------------------------------------------------------------


def test_ctrl_c_names_the_command_to_run_again(cluster):
    cluster.define("gamma", "vm1", [0x11], running=True)
    args = ("attach", "vm1", "0x10", *GAMMA)
    res = _run(cluster.state_path, *args, fault="attach:after-hotplug=INT")
    assert res.returncode == 130
    again = f"vmlend --state {cluster.state_path} attach vm1 0x10 -c sim:///gamma"
    assert res.stderr == (
        f"vmlend: interrupted; run '{again}' again to finish (it picks up where this one"
        " stopped), then 'vmlend reconcile' to check\n"
    )
    assert _run(cluster.state_path, *args).returncode == 0
    _consistent(cluster)


# --- SIGSTOP ---------------------------------------------------------------------------------


def test_stop_freezes_the_process_at_the_point_until_sigcont(tmp_path):
    """``=STOP`` (the nemesis test's frozen hook): the process stops itself at the point and
    goes on from there, exactly once resumed."""
    code = "from vmlend.faults import fault_point; print('before', flush=True);"
    code += " fault_point('prepare:after-device'); print('after', flush=True)"
    env = {**os.environ, FAULT_ENV: "prepare:after-device=STOP"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "before\n"
        deadline = time.monotonic() + 30
        while _state(proc.pid) != "T":
            assert time.monotonic() < deadline, "never stopped"
            time.sleep(0.02)
        proc.send_signal(signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
        assert out == "after\n" and proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]
