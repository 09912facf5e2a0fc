"""``vmlend status`` on the kernel backend shows each device's peer-to-peer maps: the
``p2p-map`` records vmlend keeps from ``p2p_state`` and, under ``--json`` key ``driver_p2p``,
what the SmartIO driver reports (docs/smartio-contract.md section 8)."""

# ruff: noqa: F811 (the tests take the imported fixtures as parameters)

from __future__ import annotations

import uuid

from tests.support.p2p_host import BARS_B, p2p, web_with_maps  # noqa: F401
from tests.support.smartio_host import WEB, fake, state  # noqa: F401
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, mdev_uuid, new_domain, read_domain
from vmlend.kernel.backend import SmartioFabric
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.ops.status import collect, usage_rows
from vmlend.registry import SqliteRegistry
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.views.status import render_status

VID = uuid.UUID(WEB.vm_uuid)
GPUS = (0x10, 0x20)
UA, UB = (str(mdev_uuid(VID, f)) for f in GPUS)


def test_status_shows_the_maps_the_driver_reports(tmp_path, state, fake, p2p):
    with web_with_maps(tmp_path, state, fake, p2p) as (hv, fabric):
        with fabric.registry.read() as tx:
            runtime = tx.runtime()
        (vm,) = collect(hv, fabric, runtime)
        a = next(d for d in vm.devices if d.fdid == 0x10)
        js = a.to_json()
        token = fabric._state.holds()[0x10].token
        text = render_status([vm], usage_rows(fabric.usage()))
    driver = js["driver_p2p"]
    assert driver["token"] == token
    assert [b["bar"] for b in driver["guest_bars"]] == [0, 1, 3]
    assert driver["maps"][1] == {
        "target": "0x20",
        "bar": 1,
        "gpa": BARS_B[1],
        "size": 32 << 30,
        "case": "other-lender",
        "adapter": 0,
        "segments": [30, 29, 28, 27, 26, 25, 24, 23],
    }
    assert sorted(m["key"] for m in js["p2p_maps"]) == ["0x20/bar0", "0x20/bar1", "0x20/bar3"]
    assert "0x20/bar1" in text


def test_without_the_files_there_is_no_report(tmp_path, state, fake):
    fake.smartio.data_path = False
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    spec = DomainSpec(name="web", memory_bytes=8 << 30, uuid=VID, devices=[DeviceRequest(0x10)])
    hv.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    hv.start("web")
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        acquire_device(fabric, WEB, 0x10, UA, UndoJournal(), guest_ram=read_domain(
            hv.xml("web"), strict=False).guest_ram)  # fmt: skip
        (vm,) = collect(hv, fabric, [])
    assert vm.devices[0].to_json()["driver_p2p"] is None
