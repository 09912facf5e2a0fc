"""Plug requests served by the agent (the destination of a live migration on the kernel
backend plugs the VM's devices back in, ``vmlend.ops.plug_request``): on a thread of its own,
every interval, while the lease is settled; each request's hot-plugs run on its VM's own worker
(``vmlend.agent.guest``), so nothing else acts on the VM meanwhile. Only a request that matches
a live migration the registry shows in progress is plugged; the others are refused and what is
no request is removed, one log line each (``serve_plug_requests``)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from vmlend.agent.trouble import Trouble
from vmlend.errors import VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hypervisor.base import Hypervisor
from vmlend.ops.plug_request import PlugOutcome, PlugRequest, PlugRequests, plug_here
from vmlend.ops.plug_request import serve_plug_requests as serve_plugs

if TYPE_CHECKING:
    from vmlend.agent.service import Agent

log = logging.getLogger(__name__)


class PlugServer:
    """Serves plug requests on a thread of its own, every interval, while the lease is
    settled; each request's hot-plugs run on its VM's own worker (nothing else acts on the VM
    meanwhile), on that worker's fabric."""

    def __init__(self, agent: Agent, hv: Hypervisor) -> None:
        self._agent = agent
        self._hv = hv
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, interval: float) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="plug-requests", daemon=True
        )
        self._thread.start()

    def _plug(self, req: PlugRequest) -> list[PlugOutcome]:
        future = self._agent.borrower.submit(
            req.vm, lambda hv, fabric: plug_here(hv, fabric)(req)
        )
        try:
            result: list[PlugOutcome] = future.result(timeout=self._agent.config.ttl * 6)
        except FutureTimeout:
            return [PlugOutcome(d.fdid, False, "not plugged in time") for d in req.devices]
        return result

    def _run(self, interval: float) -> None:
        agent = self._agent
        fabric: Fabric | None = None
        trouble = Trouble(log, "serving plug requests")
        try:
            while not self._stop.wait(interval):
                if not agent.clock.view().settled:
                    continue
                try:
                    if fabric is None:
                        fabric = agent.open_fabric()
                    requests = PlugRequests(agent.registry_of(fabric))
                    agent.plugged.extend(serve_plugs(requests, agent.config.node, self._plug))
                    trouble.cleared()
                except VmlendError as e:  # the next pass may do better
                    trouble.failed(e)
                except Exception as e:  # a bug must not end the service: said once, retried
                    trouble.failed(f"internal error: {type(e).__name__}: {e}")
        finally:
            if fabric is not None:
                fabric.close()

    def stop(self, timeout: float) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("a plug request is still being served as the agent stops")
