"""``vmlend status`` on the kernel backend shows each device's DMA windows as its SmartIO
driver reports them (docs/smartio-contract.md section 8), in text and ``--json``."""

# ruff: noqa: F811 (the tests take the imported fixtures as parameters)

from __future__ import annotations

import uuid

from tests.support.smartio_host import NVME, WEB, fake, state  # noqa: F401
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, mdev_uuid, new_domain, read_domain
from vmlend.kernel.backend import SmartioFabric
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.ops.status import collect, read_runtime, usage_rows
from vmlend.registry import SqliteRegistry
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.views.status import render_status

MDEV = str(mdev_uuid(uuid.UUID(WEB.vm_uuid), NVME))


def test_status_shows_the_drivers_windows_and_state(tmp_path, state, fake):
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    spec = DomainSpec(
        name="web", memory_bytes=6 << 30, uuid=uuid.UUID(WEB.vm_uuid), devices=[DeviceRequest(NVME)]
    )
    hv.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    hv.start("web")
    ram = read_domain(hv.xml("web"), strict=False).guest_ram
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        acquire_device(fabric, WEB, NVME, MDEV, UndoJournal(), guest_ram=ram)
        token = fabric._state.holds()[NVME].token
        fake.smartio.bus_master(MDEV)
        (vm,) = collect(hv, fabric, [])
        (dev,) = vm.devices
        js = dev.to_json()["driver_dma"]
        assert js["token"] == token
        assert [w["name"] for w in js["windows"]] == ["low", "high"]
        assert js["windows"][0]["ranges"] == [{"start": 0, "end": 0x80000000}]
        assert js["state"]["word"] == "mapped"
        assert js["state"]["windows"][1]["segments"] == [1]
        text = render_status([vm], usage_rows(fabric.usage()))
    assert "DRIVER'S DMA WINDOWS" in text
    assert f"token {token}: low 0x0-0x80000000; high 0x100000000-0x200000000" in text
    assert "mapped low 0x0-0x80000000; high 0x100000000-0x200000000" in text


def test_without_a_report_nothing_is_shown(tmp_path, state, fake):
    fake.smartio.data_path = False
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    spec = DomainSpec(
        name="web", memory_bytes=1 << 30, uuid=uuid.UUID(WEB.vm_uuid), devices=[DeviceRequest(NVME)]
    )
    hv.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    hv.start("web")
    ram = read_domain(hv.xml("web"), strict=False).guest_ram
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        acquire_device(fabric, WEB, NVME, MDEV, UndoJournal(), guest_ram=ram)
        (vm,) = collect(hv, fabric, [])
        assert vm.devices[0].to_json()["driver_dma"] is None
        assert "DRIVER'S DMA WINDOWS" not in render_status([vm], [])


def test_status_shows_the_recorded_windows_and_a_refusal(tmp_path, state, fake):
    """What ``SMARTIO_DMA`` made vmlend keep (``SmartioFabric.record_dma``): the windows in the
    DMA column, or the refusal when nothing is mapped, also in ``--json``."""
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    spec = DomainSpec(
        name="web", memory_bytes=6 << 30, uuid=uuid.UUID(WEB.vm_uuid), devices=[DeviceRequest(NVME)]
    )
    hv.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    hv.start("web")
    ram = read_domain(hv.xml("web"), strict=False).guest_ram
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        acquire_device(fabric, WEB, NVME, MDEV, UndoJournal(), guest_ram=ram)
        fake.smartio.bus_master(MDEV)
        assert fabric.record_dma(MDEV) is not None
        (vm,) = collect(hv, fabric, read_runtime(state))
        js = vm.devices[0].to_json()
        assert [w["key"] for w in js["dma_windows"]] == ["high", "low"]
        assert js["dma_refusal"] is None
        row = render_status([vm], usage_rows(fabric.usage())).splitlines()[1]
        assert " high,low " in row

        token = fabric._state.holds()[NVME].token
        fake.smartio.bus_master(MDEV, on=False)
        fabric.driver.write_dma_windows(NVME, MDEV, token, f"token {token}\n")
        fake.smartio.bus_master(MDEV)
        assert fabric.record_dma(MDEV) == (
            "refused ENODATA: no DMA windows were written for this child"
        )
        (vm,) = collect(hv, fabric, read_runtime(state))
        js = vm.devices[0].to_json()
        assert js["dma_windows"] == []
        assert js["dma_refusal"] == {
            "error": "ENODATA",
            "reason": "no DMA windows were written for this child",
            "mdev": MDEV,
        }
        row = render_status([vm], usage_rows(fabric.usage())).splitlines()[1]
        assert " refused ENODATA " in row
