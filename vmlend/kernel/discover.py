"""Read this host's description from its SmartIO driver: its node id, its NTB adapters and
their cables, the devices installed in it (docs/smartio-contract.md, sections 1 and 2), and its
RAM from ``/proc/meminfo``. What ``vmlend fabric discover`` merges into the topology."""

from __future__ import annotations

import re

from vmlend.errors import HostError
from vmlend.hostenv import HostEnv
from vmlend.kernel.adapters import read_adapters
from vmlend.kernel.driver import MODULE, Availability, SmartioDevice, SmartioDriver
from vmlend.topology.discovered import FoundDevice, FoundHost

_MEMTOTAL_RE = re.compile(r"^MemTotal:\s+(\d+) kB$", re.M)
MiB = 1 << 20


def _found(d: SmartioDevice) -> FoundDevice:
    return FoundDevice(
        fdid=d.fdid,
        adapter=d.lender_adapter,
        bdf=d.lender_bdf,
        kind=d.kind,
        vendor_id=d.vendor_id,
        device_id=d.device_id,
        class_code=d.class_code,
        dma_bits=d.dma_bits,
        bars=d.bars,
        physfn=d.physfn,
        # the lender's own view: 'unreachable' is about paths to it, not its offer
        lent=d.availability is not Availability.UNLENT,
    )


def host_ram(env: HostEnv) -> int | None:
    """``MemTotal`` in bytes, rounded down to MiB; None when ``proc/meminfo`` says nothing."""
    try:
        text = (env.proc / "meminfo").read_text(errors="replace")
    except OSError:
        return None
    m = _MEMTOTAL_RE.search(text)
    if m is None:
        return None
    ram = int(m.group(1)) * 1024 // MiB * MiB
    return ram if ram >= MiB else None


def read_host(env: HostEnv, hostname: str) -> FoundHost:
    """This host as its driver describes it. ``HostError`` without the driver; a damaged
    node id or adapter is a ``SysfsAttributeError``; a damaged device is left out, named in
    ``damaged``."""
    driver = SmartioDriver(env)
    if not driver.loaded():
        raise HostError(
            f"the SmartIO driver is not loaded ({driver.base / 'node_id'} is missing): load it"
            f" ('modprobe {MODULE}') and run 'vmlend fabric discover' again; without it, describe"
            " the host in a topology file ('vmlend fabric init --topology FILE')"
        )
    node_id = driver.node_id()
    adapters = read_adapters(env)
    devices, damaged = driver.scan()
    own = [_found(d) for d in devices if d.lender_node_id == node_id]
    return FoundHost(
        node_id=node_id,
        hostname=hostname,
        adapters=tuple(adapters),
        devices=tuple(own),
        ram=host_ram(env),
        remote_devices=len(devices) - len(own),
        damaged=tuple(str(e) for e in damaged),
    )

