"""``vmlend doctor``'s data-path check: each SmartIO child's DMA windows as its driver reports
them (docs/smartio-contract.md section 8), one line per problem and what to do."""

from __future__ import annotations

import pytest

from tests.support.doctor_host import checks, healthy
from vmlend.doctor import Status
from vmlend.kernel.mdev import MdevBus

U = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
CREATE = "sys/class/mdev_bus/smartio-12/mdev_supported_types/smartio-lend/create"


@pytest.fixture
def fake(tmp_path):
    fake = healthy(tmp_path)
    MdevBus(fake.env, fake).create("smartio-12", "smartio-lend", U)
    return fake


def _write(fake, text: str) -> None:
    fake.write(fake.env.mdev_devices / U / "smartio" / "dma_windows", text)


def test_no_child_no_check(tmp_path):
    assert "data path" not in checks(healthy(tmp_path).env)


def test_written_windows_pass(fake):
    _write(fake, "token 1\nlow 0x0 0x40000000\n")
    f = checks(fake.env)["data path"]
    assert f.status is Status.OK
    assert f.detail == "1 children: DMA windows written, 0 mapped by the guest"
    fake.smartio.bus_master(U)
    assert "1 mapped" in checks(fake.env)["data path"].detail


def test_no_windows_written(fake):
    f = checks(fake.env)["data path"]
    assert f.status is Status.WARN
    assert f.detail == (
        f"mdev {U} (smartio-12) has no DMA windows written: a Bus Master enable is refused;"
        " run 'vmlend reconcile --fix'"
    )


def test_a_refusal_and_a_mapping_other_than_written(fake):
    _write(fake, "token 1\nlow 0x0 0x40000000\n")
    fake.smartio.set_dma_state(U, "refused ENOSPC 2 of 3 segments free\n")
    f = checks(fake.env)["data path"]
    assert f.status is Status.WARN and "ENOSPC 2 of 3 segments free" in f.detail
    fake.smartio.set_dma_state(U, "mapped\nlow 0 0 0x0 0x20000000\n")
    assert "the driver maps low 0x0-0x20000000" in checks(fake.env)["data path"].detail


def test_a_driver_without_the_group_is_a_warning(tmp_path):
    fake = healthy(tmp_path)
    fake.smartio.data_path = False
    MdevBus(fake.env, fake).create("smartio-12", "smartio-lend", U)
    f = checks(fake.env)["data path"]
    assert f.status is Status.WARN and "predates the data path" in f.detail


def test_a_damaged_file_is_a_warning_naming_it(fake):
    fake.smartio.set_dma_state(U, "mapping\n")
    f = checks(fake.env)["data path"]
    assert f.status is Status.WARN and "dma_state" in f.detail and "unknown state" in f.detail
