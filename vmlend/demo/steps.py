"""The steps of the story. Each takes the ``Story`` and returns its data (JSON-able); a step
that cannot show what it should raises ``DemoError``. The report renders the data."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import msgspec

from vmlend.demo import facts
from vmlend.demo.cluster import DemoCluster
from vmlend.demo.context import Json, Story, require
from vmlend.demo.libvirt_check import libvirt_accepts
from vmlend.demo.nvmeshare import nvme_share_step
from vmlend.demo.traffic import (
    dma_into_guest,
    hole_fault,
    interrupts,
    link_failover,
    p2p_write,
)
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain, read_domain
from vmlend.memory.domain_memory import domain_layout
from vmlend.ops.attach import apply_attach, plan_attach
from vmlend.ops.detach import detach
from vmlend.ops.migrate import migrate
from vmlend.ops.status import collect, read_runtime, usage_rows
from vmlend.topology.model import DeviceState, GiB, format_fdid
from vmlend.views.devices import device_json
from vmlend.views.fabric import fabric_json
from vmlend.views.status import render_status
from vmlend.wiring.fabric import default_topology_text, init_fabric

# --- 1. the fabric -------------------------------------------------------------------------------


def fabric_step(s: Story) -> Json:
    text, source = default_topology_text()
    init = init_fabric(s.state_path, text, source, node=s.config.borrower)
    s.cluster = DemoCluster(s.state_path, backing=s.config.backing)
    cleaned = s.c.remove_vm(s.config.vm)
    f = s.c.fabric(s.config.borrower)
    return {
        "action": init.action,
        "state": str(s.state_path),
        "local_node": init.local_node,
        "cleaned_up": cleaned,
        "fabric": fabric_json(f),
        "devices": [device_json(st) for st in f.devices()],
    }


# --- 2. the domain XML ---------------------------------------------------------------------------


def xml_step(s: Story) -> Json:
    cfg = s.config
    fabric = s.c.fabric(cfg.borrower)
    spec = DomainSpec(
        name=cfg.vm,
        memory_bytes=cfg.memory,
        vcpus=cfg.vcpus,
        machine=cfg.machine,
        uuid=uuid.uuid4(),
        devices=[DeviceRequest(f) for f in cfg.devices],
    )
    doc = new_domain(spec, templates=TemplateSet(), validate_fdid=fabric.device)
    s.xml = doc.to_bytes()
    info = read_domain(s.xml)
    s.uuid = str(info.uuid)
    layout = domain_layout(s.xml)
    accepted = libvirt_accepts(s.xml)
    require(
        accepted["mdevs"] == [str(d.mdev) for d in info.devices],
        "libvirt's test driver did not keep the mdev hostdevs of the generated XML",
    )
    return {
        "name": info.name,
        "uuid": s.uuid,
        "memory": cfg.memory,
        "machine": cfg.machine,
        "ram": [[r.start, r.end] for r in layout.ranges()],
        "devices": [
            {"fdid": format_fdid(d.fdid), "mdev": str(d.mdev), "lender": _lender(s, d.fdid)}
            for d in info.devices
        ],
        "libvirt": accepted,
        "xml": s.xml.decode(),
    }


def _lender(s: Story, fdid: int) -> str:
    return s.c.hw.device(fdid).lender


# --- 3. define and start -------------------------------------------------------------------------


def start_step(s: Story) -> Json:
    cfg = s.config
    s.node = cfg.borrower
    hv = s.c.hypervisor(s.node)
    mark = len(s.c.hook_calls)
    hv.define(s.xml)
    hv.start(cfg.vm)
    fabric = s.c.fabric(s.node)
    states = facts.device_states(fabric, s.c.registry, list(cfg.devices))
    require(
        all(d["state"] == DeviceState.RESERVED.value for d in states),
        "after the start every device should be reserved, not yet borrowed (deferred borrow)",
    )
    require(all(d["mdev"] for d in states), "the hook did not create every mdev")
    return {
        "uri": hv.uri,
        "hooks": s.hook_calls_since(mark),
        "devices": states,
        "adapters": facts.adapter_use(fabric, s.c.hw),
    }


# --- 4. the guest enables its devices ------------------------------------------------------------


def enable_step(s: Story) -> Json:
    cfg = s.config
    guest = s.c.guest(s.node)
    wired = guest.load_drivers(cfg.vm)
    fabric = s.c.fabric(s.node)
    states = facts.device_states(fabric, s.c.registry, s.devices())
    require(
        all(d["state"] == DeviceState.BORROWED.value for d in states),
        "the guest's enable should have borrowed every device",
    )
    windows = facts.windows(s.c.registry)
    remote = [f for f in s.devices() if _lender(s, f) != s.node]
    for fdid in remote:
        keys = {w["key"] for w in windows if w["fdid"] == format_fdid(fdid)}
        require(
            {"low", "high"} <= keys,
            f"device {fdid:#x} should have a low and a high DMA window, has {sorted(keys)}",
        )
    maps = facts.p2p_maps(guest.guest(cfg.vm).p2p.maps())
    pairs = {(m["source"], m["target"]) for m in maps}
    a, b = (format_fdid(g) for g in cfg.gpus)
    nvme = format_fdid(cfg.nvme)
    for pair in ((a, b), (b, a), (a, nvme), (nvme, a)):
        require(pair in pairs, f"no peer-to-peer map from {pair[0]} to {pair[1]}")
    # What `vmlend status` (another process, reading the shared state) shows meanwhile.
    views = collect(s.c.hypervisor(s.node), fabric, read_runtime(s.c.state_path), cfg.vm)
    for view in views:
        for d in view.devices:
            require(
                bool(d.runtime.get("irq-vector")) and bool(d.runtime.get("dma-window")),
                f"status should show the vectors and DMA windows of {d.fdid:#x}",
            )
    return {
        "devices": states,
        "guest_bars": _guest_bars(s),
        "windows": windows,
        "vectors": [w.json() for w in wired],
        "p2p": maps,
        "adapters": facts.adapter_use(fabric, s.c.hw),
        "status": render_status(views, usage_rows(fabric.usage())),
    }


def _guest_bars(s: Story) -> list[Json]:
    vm = s.vm()
    return [
        {"fdid": format_fdid(b.fdid), "bar": b.index, "gpa": b.address, "size": b.size}
        for f in vm.devices()
        for b in vm.bars(f)
    ]


# --- 5. traffic ----------------------------------------------------------------------------------


def traffic_step(s: Story) -> Json:
    cfg = s.config
    a, b = cfg.gpus
    high = s.vm().layout.above_4g_start + GiB + 0x1234_5000
    return {
        "dma": [dma_into_guest(s, cfg.nvme, high)],
        "p2p": [
            p2p_write(s, a, b, 1, 0x10_0000, b"GPU 0x10 -> GPU 0x20 BAR1, peer to peer"),
            p2p_write(s, b, cfg.nvme, 0, 0x1000, b"\x01\x00\x00\x00"),
        ],
        "fault": hole_fault(s, cfg.nvme),
        "interrupts": interrupts(s, s.devices()),
        "failover": link_failover(s, cfg.nvme, high),
    }


# --- 6. hot-add and hot-remove -------------------------------------------------------------------


def hotplug_step(s: Story) -> Json:
    cfg = s.config
    hv = s.c.hypervisor(s.node)
    fabric = s.c.fabric(s.node)
    fdid = cfg.hot_add
    before = facts.adapter_use(fabric, s.c.hw)
    plan = plan_attach(hv, fabric, cfg.vm, fdid, live=True, config=False)
    if not plan.ok:
        raise plan.refusal()
    steps: list[str] = []
    apply_attach(hv, fabric, plan, steps.append)
    require(fdid in s.devices(), f"the guest did not see device {fdid:#x} arrive")
    state = facts.device_states(fabric, s.c.registry, [fdid])[0]
    require(
        state["state"] == DeviceState.BORROWED.value, "the guest's driver did not enable the VF"
    )
    added = facts.adapter_use(fabric, s.c.hw)
    windows = [w for w in facts.windows(s.c.registry) if w["fdid"] == format_fdid(fdid)]
    dma = dma_into_guest(s, fdid, 0x10_0000, 4096)
    irqs = interrupts(s, [fdid])
    res = detach(hv, fabric, cfg.vm, fdid, live=True, config=False, progress=steps.append)
    after = facts.adapter_use(fabric, s.c.hw)
    final = fabric.device(fdid)
    require(fdid not in s.devices(), f"device {fdid:#x} is still in the guest")
    require(final.holder is None, f"device {fdid:#x} is still held by {final.holder}")
    require(after == before, "the adapters' accounting after the hot-remove differs from before")
    return {
        "device": format_fdid(fdid),
        "kind": state["kind"],
        "lender": state["lender"],
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in plan.checks],
        "attached": state,
        "windows": windows,
        "dma": dma,
        "interrupts": irqs,
        "returned": res.returned,
        "state_after": final.state.value,
        "adapters": {"before": before, "attached": added, "after": after},
        "steps": steps,
    }


# --- 7. cold migration ---------------------------------------------------------------------------


def migrate_step(s: Story) -> Json:
    cfg = s.config
    src_node, dst_node = s.node, cfg.migrate_to
    src, dst = s.c.hypervisor(src_node), s.c.hypervisor(dst_node)
    mark = len(s.c.hook_calls)
    res = migrate(
        src,
        dst,
        s.c.fabric(src_node),
        cfg.vm,
        dst_node,
        start=True,
        shutdown_timeout=cfg.shutdown_timeout,
    )
    s.node = dst_node
    moved = read_domain(dst.xml(cfg.vm, inactive=True))
    require(
        [d.fdid for d in moved.devices] == list(cfg.devices),
        "the migrated domain names other devices than before",
    )
    wired = s.c.guest(dst_node).load_drivers(cfg.vm)
    fabric = s.c.fabric(dst_node)
    states = facts.device_states(fabric, s.c.registry, s.devices())
    require(
        all(d["state"] == DeviceState.BORROWED.value for d in states),
        f"on {dst_node} the guest's enable should have borrowed every device",
    )
    remote_gpu = next(f for f in cfg.gpus if _lender(s, f) != dst_node)
    high = s.vm().layout.above_4g_start + 2 * GiB
    return {
        "from": src_node,
        "to": dst_node,
        "steps": res.steps,
        "hooks": s.hook_calls_since(mark),
        "devices": [
            d | {"path": "local" if d["lender"] == dst_node else f"NTB {d['lender']}->{dst_node}"}
            for d in states
        ],
        "windows": facts.windows(s.c.registry),
        "vectors": [w.json() for w in wired],
        "p2p": facts.p2p_maps(s.c.guest(dst_node).guest(cfg.vm).p2p.maps()),
        "dma": [dma_into_guest(s, cfg.nvme, high), dma_into_guest(s, remote_gpu, high + GiB)],
        "p2p_write": [
            p2p_write(s, cfg.gpus[0], cfg.gpus[1], 1, 0x20_0000, b"after the move, still P2P")
        ],
        "interrupts": interrupts(s, s.devices()),
        "adapters": facts.adapter_use(fabric, s.c.hw),
    }


# --- 8. stop -------------------------------------------------------------------------------------


def stop_step(s: Story) -> Json:
    cfg = s.config
    hv = s.c.hypervisor(s.node)
    mark = len(s.c.hook_calls)
    hv.shutdown(cfg.vm, cfg.shutdown_timeout)
    fabric = s.c.fabric(s.node)
    left = facts.leftovers(fabric, s.c.registry, s.c.hw, cfg.vm)
    busy = {k: v for k, v in left.items() if v}
    require(
        not busy, "still in use after the stop: " + ", ".join(f"{k}={v}" for k, v in busy.items())
    )
    return {
        "node": s.node,
        "uri": hv.uri,
        "hooks": s.hook_calls_since(mark),
        "left": left,
        "devices": facts.device_states(fabric, s.c.registry, list(cfg.devices)),
        "defined_on": s.node,
        "state": str(s.state_path),
    }


class Step(msgspec.Struct, frozen=True):
    key: str
    title: str
    run: Callable[[Story], Json]


STEPS: list[Step] = [
    Step("fabric", "The simulated cluster: nodes, NTB adapters, devices", fabric_step),
    Step("xml", "The VM's domain XML, accepted by libvirt", xml_step),
    Step("start", "Define and start the VM on gamma: the hook reserves", start_step),
    Step("enable", "The guest enables its devices: borrow, DMA windows, vectors, P2P", enable_step),
    Step(
        "traffic",
        "Traffic: DMA into guest RAM, peer-to-peer, a fault, interrupts, a link failover",
        traffic_step,
    ),
    Step("hotplug", "Hot-add a VF to the running VM, then remove it", hotplug_step),
    Step("migrate", "Cold-migrate the VM to alpha; its devices work there", migrate_step),
    Step("stop", "Stop the VM: everything is returned", stop_step),
    Step(
        "nvme-share",
        "Two VMs on two hosts share the NVMe drive; the guard rejects a stray command",
        nvme_share_step,
    ),
]
