"""One borrower cut off from etcd by a ``TcpProxy``: its agent and hooks talk to etcd through
the proxy, the lender's agent directly. Shared by the test (behaviour) and the bench (how long
from the cut to the paused VM)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.cluster_hosts import GPU, WEB, Host, domain_xml
from tests.support.etcd_daemon import EtcdServer
from tests.support.tcp_proxy import TcpProxy
from vmlend.hypervisor.base import DomainState, Hypervisor
from vmlend.wiring.fabric import default_topology_text, init_fabric


@dataclass
class CutOff:
    direct_url: str
    proxy: TcpProxy
    alpha: Host
    gamma: Host
    hv: Hypervisor
    ttl: int

    def state(self) -> DomainState:
        return self.hv.lookup("web").state


def wait_for(what: str, check, host: Host, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} never happened\n{host.log()}"
        time.sleep(0.02)


@contextmanager
def cut_off_borrower(server: EtcdServer, root: Path, cluster: str, ttl: int) -> Iterator[CutOff]:
    """alpha lends 0x10 to VM web on gamma, whose agent (``--ttl ttl``) and hook reach etcd
    through a proxy; the caller cuts and heals it. Agents are stopped by PID afterwards."""
    from vmlend.wiring.hypervisor import open_hypervisor

    direct = server.url(cluster)
    text, source = default_topology_text()
    init_fabric(direct, text, source)
    proxy = TcpProxy(server.client_port)
    via_proxy = f"etcd://{proxy.endpoint}/{cluster}"
    alpha = Host(direct, "alpha", root / "alpha")
    gamma = Host(via_proxy, "gamma", root / "gamma")
    saved = os.environ.get("VMLEND_ROOT")
    os.environ["VMLEND_ROOT"] = str(gamma.root)
    try:
        alpha.start_agent()
        gamma.start_agent("--ttl", str(ttl), "--connect", "sim:///gamma")
        wait_for("gamma's start-up", lambda: "reconcile of gamma done" in gamma.log(), gamma)
        hook = [sys.executable, "-m", "vmlend.hook", "--registry", via_proxy, "--node", "gamma"]
        hv = open_hypervisor("sim:///gamma", state_dir=gamma.root, hook_command=hook)
        hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
        hv.start("web")
        yield CutOff(direct, proxy, alpha, gamma, hv, ttl)
    finally:
        proxy.heal()
        for h in (gamma, alpha):
            h.stop_agent()
        proxy.close()
        if saved is None:
            os.environ.pop("VMLEND_ROOT", None)
        else:
            os.environ["VMLEND_ROOT"] = saved


def cut_to_pause(c: CutOff) -> float:
    """Cut the borrower off; seconds until its VM is paused."""
    c.proxy.cut()
    cut = time.monotonic()
    wait_for("the VM paused", lambda: c.state() is DomainState.PAUSED, c.gamma, 3 * c.ttl + 30)
    return time.monotonic() - cut
