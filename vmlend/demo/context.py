"""What the steps share: the demo's configuration and the story so far (``Story``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from vmlend.demo.cluster import DemoCluster
from vmlend.errors import DemoError
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import GiB

Json = dict[str, Any]


class DemoConfig(msgspec.Struct, frozen=True):
    """What the story is told with (the defaults fit the shipped three-node cluster)."""

    vm: str = "demo"
    memory: int = 8 * GiB
    vcpus: int = 2
    machine: str = "q35"
    #: Host page size backing the guest's RAM: 1 GiB pages keep pinning and mapping quick.
    backing: int = GiB
    borrower: str = "gamma"
    devices: tuple[int, ...] = (0x10, 0x20, 0x12)  # GPU from alpha, GPU from beta, NVMe
    gpus: tuple[int, int] = (0x10, 0x20)
    nvme: int = 0x12
    hot_add: int = 0x22  # a VF of beta's NIC
    migrate_to: str = "alpha"
    interrupts: int = 1000  # raised per device
    shutdown_timeout: float = 10.0


class Story(msgspec.Struct):
    """What the steps share."""

    state_path: Path
    config: DemoConfig
    cluster: DemoCluster | None = None
    xml: bytes = b""
    uuid: str = ""
    node: str = ""  # where the VM is defined now

    @property
    def c(self) -> DemoCluster:
        assert self.cluster is not None, "the first step opens the cluster"
        return self.cluster

    def vm(self) -> SimVm:
        return self.c.guest(self.node).guest(self.config.vm).vm

    def devices(self) -> list[int]:
        return self.vm().devices()

    def hook_calls_since(self, mark: int) -> list[Json]:
        return [
            {
                "node": h.node,
                "argv": list(h.args),
                "exit": h.returncode,
                "ms": round(h.seconds * 1000, 1),
            }
            for h in self.c.hook_calls[mark:]
        ]


def require(ok: bool, what: str) -> None:
    if not ok:
        raise DemoError(what)
