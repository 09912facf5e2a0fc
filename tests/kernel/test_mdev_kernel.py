"""``vmlend mdev`` and ``MdevBus`` on the real kernel: the mdev core and the SmartIO stand-in's
parent (the kernel's mtty sample, renamed; borrowed by hand here) decide every answer (no fake
writer, no fake tree)."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
from click.testing import CliRunner

from tests.support.kernel_guest import FOREIGN, LEND, PORTS, REAL, STUB, parent_dir
from vmlend.cli import main
from vmlend.errors import MdevNoInstancesError, MdevUuidInUseError
from vmlend.kernel.mdev import KernelWriter, MdevBus

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002"
#: The parent: the stand-in's device 0x12, borrowed (its mdev parent registered).
PARENT = "smartio-12"
PARENT_DIR = parent_dir(0x12)


@pytest.fixture(autouse=True)
def parent(fabric_devices):
    STUB.command("borrow", "0x12")


def available(type_id):
    return MdevBus(REAL).parent(PARENT).type(type_id).available_instances


def run(*args):
    return CliRunner().invoke(main, ["--root", "/", "mdev", *args])


def by_parent(doc):
    return {
        (parent, key): fields
        for parent, entries in doc["parents"].items()
        for entry in entries
        for key, fields in entry.items()
    }


def test_types_lists_the_parents_two_types():
    r = run("types", "--json")
    assert r.exit_code == 0, r.output
    rows = by_parent(json.loads(r.output))
    assert set(rows) == {(PARENT, FOREIGN), (PARENT, LEND)}
    assert rows[PARENT, FOREIGN]["device_api"] == "vfio-pci"
    assert rows[PARENT, FOREIGN]["available_instances"] == PORTS  # one port each
    assert rows[PARENT, LEND]["available_instances"] == 1  # two ports each
    assert rows[PARENT, FOREIGN]["name"] == "Single port serial"
    assert rows[PARENT, LEND]["name"] == "SmartIO lent device"
    assert rows[PARENT, LEND]["devices"] == []


def test_create_list_remove_through_the_kernel():
    r = run("create", PARENT, LEND, U1)
    assert r.exit_code == 0, r.output
    assert r.output.strip() == U1
    # The kernel made the device: the bus link, its type link and its IOMMU group.
    dev = REAL.mdev_devices / U1
    assert (dev / "mdev_type").resolve() == PARENT_DIR / "mdev_supported_types" / LEND
    group = (dev / "iommu_group").resolve()
    assert group.parent == REAL.sys / "kernel" / "iommu_groups"
    assert (REAL.dev / "vfio" / group.name).exists()  # VFIO made the group's character device
    assert available(LEND) == 0 and available(FOREIGN) == PORTS - 2  # the driver counts ports

    r = run("list", "--json")
    rows = by_parent(json.loads(r.output))
    assert rows[PARENT, U1] == {
        "mdev_type": LEND,
        "start": "manual",
        "iommu_group": int(group.name),
    }

    r = run("remove", U1, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["action"] == "removed"
    assert not dev.exists()
    assert available(LEND) == 1
    assert json.loads(run("list", "--json").output)["parents"] == {}


def test_the_installed_command_works_too():
    """Once as root would run it: the venv's console script, a fresh interpreter."""
    env = {**os.environ, "VMLEND_ROOT": "/"}
    out = subprocess.run(
        ["vmlend", "mdev", "create", "-p", PARENT, "-t", FOREIGN, "-u", U2],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == U2
    out = subprocess.run(
        ["vmlend", "mdev", "list"], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert U2 in out.stdout and FOREIGN in out.stdout
    subprocess.run(["vmlend", "mdev", "remove", "-u", U2], env=env, timeout=120, check=True)
    assert not (REAL.mdev_devices / U2).exists()


def test_create_and_remove_are_idempotent():
    assert run("create", PARENT, FOREIGN, U1).exit_code == 0
    r = run("create", PARENT, FOREIGN, U1, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["action"] == "unchanged"
    assert available(FOREIGN) == PORTS - 1  # still one child
    assert json.loads(run("remove", U1, "--json").output)["action"] == "removed"
    r = run("remove", U1, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["action"] == "unchanged"


def test_a_uuid_in_use_on_another_type_is_refused():
    MdevBus(REAL).create(PARENT, FOREIGN, U1)
    r = run("create", PARENT, LEND, U1)
    assert r.exit_code == 1
    assert f"that UUID already exists on {PARENT}/{FOREIGN}" in r.output
    # The kernel's own refusal (what MdevBus meets when it loses a race): EEXIST.
    with pytest.raises(OSError) as e:
        KernelWriter().write(PARENT_DIR / "mdev_supported_types" / LEND / "create", U1)
    assert e.value.errno == errno.EEXIST
    assert MdevBus(REAL).device(U1).type_id == FOREIGN  # untouched


def test_losing_the_race_for_a_uuid_is_judged_by_what_the_kernel_made():
    """vmlend looked before writing and saw nothing; the kernel says EEXIST: MdevBus reads
    what is there now and names the other type."""

    class LateBus(MdevBus):
        looked = False

        def device(self, uuid):
            if not self.looked:
                self.looked = True
                return None  # the look before the write: another creator is not done yet
            return super().device(uuid)

    MdevBus(REAL).create(PARENT, FOREIGN, U1)
    with pytest.raises(MdevUuidInUseError) as e:
        LateBus(REAL).create(PARENT, LEND, U1)
    assert FOREIGN in str(e.value)
    assert LateBus(REAL).create(PARENT, FOREIGN, U1).uuid == U1  # the same type: it is ours


def test_no_instances_left_is_the_kernels_refusal():
    """Children of the other type took the parent's ports: the driver's ENOSPC."""
    bus = MdevBus(REAL)
    made = [
        bus.create(PARENT, FOREIGN, f"83b8f4f2-509f-382f-3c1e-e6bfe0fa2{i:03d}")
        for i in range(PORTS)
    ]
    assert available(LEND) == 0 and available(FOREIGN) == 0
    with pytest.raises(MdevNoInstancesError) as e:
        bus.create(PARENT, FOREIGN, U1)
    assert PARENT in str(e.value) and FOREIGN in str(e.value)
    r = run("create", PARENT, LEND, U2)
    assert r.exit_code == 1 and f"{PARENT} has no {LEND} instances left" in r.output, r.output
    assert len(made) == PORTS and bus.device(U1) is None and bus.device(U2) is None


def test_a_malformed_uuid_never_reaches_the_kernel_which_would_refuse_it():
    r = run("create", PARENT, FOREIGN, "not-a-uuid")
    assert r.exit_code == 1 and "not-a-uuid" in r.output, r.output
    with pytest.raises(OSError) as e:
        KernelWriter().write(PARENT_DIR / "mdev_supported_types" / FOREIGN / "create", "not-a-uuid")
    assert e.value.errno == errno.EINVAL
    assert MdevBus(REAL).devices() == []
