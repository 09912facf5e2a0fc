"""``vmlend vm destroy`` during an etcd outage: the VM stops within the release's bound (a few
process start-ups plus one registry call's deadline, ``RELEASE_CALL_DEADLINE``), exits 0 with
one line naming the release that is pending, and the agent lands it once etcd answers again.
Real etcd (a three-member cluster that loses its quorum; one member behind a proxy that cuts
the host off), real agent and hook processes, a simulated hypervisor.

The bound is a wall-clock duration, asserted only because the issue states it (issue 35,
point 7: "within 2 s plus one registry call's deadline"), against the deadline the code uses
and with slack for a loaded machine: before the bound, the same destroy took 10 to 11 s here
(one request timeout to check the simulated node, one more for the hook), and the issue
measured 24 s and 47 s."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.support.cluster_hosts import GPU, WEB, Host, domain_xml
from tests.support.etcd_daemon import start_members
from tests.support.partition import cut_off_borrower, wait_for
from vmlend.registry.deadline import RELEASE_CALL_DEADLINE
from vmlend.topology.model import DeviceState
from vmlend.wiring.fabric import default_topology_text, init_fabric

#: What the issue allows besides the registry call's deadline: the CLI's and the hook's
#: process start-ups, the journal's write and fsyncs.
START_UPS = 2.0
#: Slack for a loaded machine (two cores shared with other test runs).
SLACK = 2.0
BOUND = START_UPS + RELEASE_CALL_DEADLINE + SLACK


def _destroy(host: Host) -> tuple[float, int, str]:
    start = time.monotonic()
    r = host.vmlend("vm", "destroy", "web", "--connect", f"sim:///{host.node}")
    return time.monotonic() - start, r.returncode, r.stderr


def _assert_one_line_pending(code: int, stderr: str, took: float) -> None:
    assert code == 0, stderr
    assert took < BOUND, f"vm destroy took {took:.1f} s, over {BOUND:.1f} s: {stderr}"
    assert len(stderr.splitlines()) == 1, stderr
    [line] = stderr.splitlines()
    assert "release of VM 'web' is pending (0x10)" in line, line
    assert "retries it until it lands" in line, line


def _pending(host: Host) -> list[str]:
    return sorted(p.name for p in (host.root / "var/lib/vmlend/pending-releases").glob("*.json"))


@pytest.fixture
def three_members(tmp_path: Path):
    members = start_members(tmp_path / "etcd", 3)
    yield members
    for m in members:
        m.stop()


@pytest.mark.slow
@pytest.mark.daemon
def test_destroy_without_quorum_is_bounded_and_lands_when_the_quorum_is_back(
    three_members, tmp_path, monkeypatch
):
    from vmlend.wiring.fabric import open_fabric
    from vmlend.wiring.hypervisor import open_hypervisor

    first = three_members[0]
    text, source = default_topology_text()
    init_fabric(first.url("quorum"), text, source)
    url = "etcd://" + ",".join(m.endpoint for m in three_members) + "/quorum"
    gamma = Host(url, "gamma", tmp_path / "gamma")
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))
    try:
        gamma.start_agent("--ttl", "10", "--connect", "sim:///gamma")
        hook = [sys.executable, "-m", "vmlend.hook", "--registry", url, "--node", "gamma"]
        hv = open_hypervisor("sim:///gamma", state_dir=gamma.root, hook_command=hook)
        hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
        hv.start("web")

        for m in three_members[1:]:  # one member of three left: no quorum
            m.stop()
        took, code, stderr = _destroy(gamma)
        _assert_one_line_pending(code, stderr, took)
        assert _pending(gamma) == [f"{WEB.vm_uuid}.json"]

        for m in three_members[1:]:
            m.start()
        with open_fabric(first.url("quorum"), "alpha") as f:
            wait_for(
                "0x10 returned",
                lambda: f.device(GPU).state is DeviceState.AVAILABLE,
                gamma,
                timeout=60,
            )
            assert f.fenced() == []
        assert _pending(gamma) == []
    finally:
        gamma.stop_agent()


@pytest.mark.slow
def test_destroy_of_a_host_cut_off_from_etcd_is_bounded_and_lands_after_the_heal(
    private_etcd, tmp_path
):
    from vmlend.wiring.fabric import open_fabric

    with cut_off_borrower(private_etcd, tmp_path, "cut", ttl=10) as c:
        c.proxy.cut()
        took, code, stderr = _destroy(c.gamma)
        _assert_one_line_pending(code, stderr, took)
        assert _pending(c.gamma) == [f"{WEB.vm_uuid}.json"]

        c.proxy.heal()
        with open_fabric(c.direct_url, "alpha") as f:
            wait_for(
                "0x10 returned",
                lambda: f.device(GPU).state is DeviceState.AVAILABLE,
                c.gamma,
                timeout=60,
            )
            assert f.fenced() == []
        assert _pending(c.gamma) == []
