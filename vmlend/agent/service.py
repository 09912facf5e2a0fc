"""The agent's loop: keep the lease alive, publish it for the host, take back fenced devices.

Bounded and observable: each pass renews the lease every ``ttl / 3`` seconds and scans the
fences of this node's devices every ``interval`` seconds (a scan instead of a watch, so a
reconnect after an etcd outage needs no re-listing). A device whose borrower died is
borrowable again within the lease TTL plus one ``interval`` (plus one transaction).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vmlend.agent.guard import RemoteVmGuard
from vmlend.agent.lease import LeaseLost, SessionLease
from vmlend.errors import ConfigError, StateError
from vmlend.fabric.open import Location, open_fabric
from vmlend.fabric.sim.backend import SimFabric
from vmlend.hypervisor.base import Hypervisor
from vmlend.registry import EtcdRegistry, hostlease
from vmlend.registry.etcd_gateway import b64

log = logging.getLogger(__name__)

DEFAULT_TTL = 10
DEFAULT_INTERVAL = 0.5


@dataclass
class AgentConfig:
    location: Location
    node: str
    lease_file: Path
    ttl: int = DEFAULT_TTL
    interval: float = DEFAULT_INTERVAL
    #: Opens this host's hypervisor (to pause VMs with remote devices); None: none to guard.
    hypervisor: Callable[[], Hypervisor] | None = None


class Agent:
    def __init__(self, config: AgentConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.stop_event = threading.Event()
        self.taken_back: list[int] = []

    def run(self) -> int:
        """Serve until ``stop_event`` (0) or the lease is lost (3)."""
        cfg = self.config
        fabric = open_fabric(cfg.location, cfg.node)
        if not isinstance(fabric, SimFabric) or not isinstance(fabric.registry, EtcdRegistry):
            raise ConfigError(
                "'vmlend agent' serves a cluster registry: give --registry etcd://HOST:PORT/CLUSTER"
            )
        registry = fabric.registry
        lease = SessionLease(registry.gateway, cfg.ttl)
        lease.put(
            registry.keys.host(cfg.node),
            json.dumps({"pid": os.getpid(), "ttl": lease.ttl}).encode(),
        )
        # Without a lease: if this agent dies uncleanly, the marker outlives hosts/<node> and
        # marks this node's devices unavailable until an agent runs here again.
        registry.gateway.call(
            "kv/put", {"key": b64(registry.keys.agent(cfg.node)), "value": b64(b"1")}
        )
        # Last: the host's processes may use the lease once the file is there.
        hostlease.publish(
            cfg.lease_file, hostlease.HostLease(lease.id, cfg.node, lease.ttl, os.getpid())
        )
        log.warning(
            "agent for %s up: lease %x (TTL %d s) published in %s",
            cfg.node,
            lease.id,
            lease.ttl,
            cfg.lease_file,
        )
        guard = None
        if cfg.hypervisor is not None:
            guard = RemoteVmGuard(cfg.hypervisor(), fabric, cfg.node)
        in_doubt = False  # renewing failed for half the TTL: VMs with remote devices paused
        paused: list[str] = []
        renewed = self._clock()
        next_renew = renewed
        try:
            while not self.stop_event.is_set():
                now = self._clock()
                if now >= next_renew:
                    try:
                        lease.refresh()
                        renewed = now
                        if in_doubt:
                            if guard is not None:
                                guard.resume(paused)
                            in_doubt, paused = False, []
                    except LeaseLost:
                        raise
                    except StateError as e:
                        log.warning("cannot renew lease %x: %s", lease.id, e)
                        if now - renewed > lease.ttl:
                            raise LeaseLost(
                                f"lease {lease.id:x} not renewed for {lease.ttl} s"
                            ) from None
                        if not in_doubt and now - renewed > lease.ttl / 2:
                            in_doubt = True
                            paused = guard.pause() if guard is not None else []
                    # In doubt, retry often: every moment counts before the TTL runs out.
                    next_renew = now + (cfg.interval if in_doubt else lease.ttl / 3)
                self._take_back(fabric)
                self.stop_event.wait(cfg.interval)
        except LeaseLost as e:
            log.error(
                "agent for %s lost its lease (%s): this host's holds are gone; restart the agent",
                cfg.node,
                e,
            )
            if paused:
                log.error(
                    "VMs %s stay paused: their devices may be taken back; re-reserve or unplug"
                    " them before resuming",
                    ", ".join(paused),
                )
            hostlease.withdraw(cfg.lease_file, lease.id)
            return 3
        hostlease.withdraw(cfg.lease_file, lease.id)
        try:
            registry.gateway.call("kv/deleterange", {"key": b64(registry.keys.agent(cfg.node))})
            lease.revoke()  # a clean stop: this host's records go now, not after the TTL
        except StateError as e:
            log.warning("could not revoke lease %x (it ends by its TTL): %s", lease.id, e)
        fabric.close()
        log.warning("agent for %s stopped", cfg.node)
        return 0

    def _take_back(self, fabric: SimFabric) -> None:
        try:
            for fence in fabric.fenced():
                if fabric.take_back(fence):
                    self.taken_back.append(fence.fdid)
        except StateError as e:
            log.warning("cannot check fenced devices: %s", e)
