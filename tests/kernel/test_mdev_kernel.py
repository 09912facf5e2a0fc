"""``vmlend mdev`` and ``MdevBus`` on the real kernel: the mdev core and the mtty sample
parent decide every answer here (no fake writer, no fake tree)."""

from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest
from click.testing import CliRunner

from tests.support.kernel_guest import MTTY, MTTY1, MTTY2, MTTY_DIR, REAL, available
from vmlend.cli import main
from vmlend.errors import MdevNoInstancesError, MdevUuidInUseError
from vmlend.kernel.mdev import KernelWriter, MdevBus

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002"


def run(*args):
    return CliRunner().invoke(main, ["--root", "/", "mdev", *args])


def by_parent(doc):
    return {
        (parent, key): fields
        for parent, entries in doc["parents"].items()
        for entry in entries
        for key, fields in entry.items()
    }


def test_types_lists_the_kernels_mtty_types():
    r = run("types", "--json")
    assert r.exit_code == 0, r.output
    rows = by_parent(json.loads(r.output))
    assert rows[MTTY, MTTY1]["device_api"] == "vfio-pci"
    assert rows[MTTY, MTTY1]["available_instances"] == 24  # one port each, 24 ports
    assert rows[MTTY, MTTY2]["available_instances"] == 12  # two ports each
    assert rows[MTTY, MTTY1]["name"] == "Single port serial"
    assert rows[MTTY, MTTY2]["devices"] == []


def test_create_list_remove_through_the_kernel():
    r = run("create", MTTY, MTTY2, U1)
    assert r.exit_code == 0, r.output
    assert r.output.strip() == U1
    # The kernel made the device: the bus link, its type link and its IOMMU group.
    dev = REAL.mdev_devices / U1
    assert (dev / "mdev_type").resolve() == MTTY_DIR / "mdev_supported_types" / MTTY2
    group = (dev / "iommu_group").resolve()
    assert group.parent == REAL.sys / "kernel" / "iommu_groups"
    assert (REAL.dev / "vfio" / group.name).exists()  # VFIO made the group's character device
    assert available(MTTY2) == 11 and available(MTTY1) == 22  # the driver counts ports

    r = run("list", "--json")
    rows = by_parent(json.loads(r.output))
    assert rows[MTTY, U1] == {"mdev_type": MTTY2, "start": "manual", "iommu_group": int(group.name)}

    r = run("remove", U1, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["action"] == "removed"
    assert not dev.exists()
    assert available(MTTY2) == 12
    assert json.loads(run("list", "--json").output)["parents"] == {}


def test_the_installed_command_works_too():
    """Once as root would run it: the venv's console script, a fresh interpreter."""
    env = {**os.environ, "VMLEND_ROOT": "/"}
    out = subprocess.run(
        ["vmlend", "mdev", "create", "-p", MTTY, "-t", MTTY1, "-u", U2],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == U2
    out = subprocess.run(
        ["vmlend", "mdev", "list"], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert U2 in out.stdout and MTTY1 in out.stdout
    subprocess.run(["vmlend", "mdev", "remove", "-u", U2], env=env, timeout=120, check=True)
    assert not (REAL.mdev_devices / U2).exists()


def test_create_and_remove_are_idempotent():
    assert run("create", MTTY, MTTY1, U1).exit_code == 0
    r = run("create", MTTY, MTTY1, U1, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["action"] == "unchanged"
    assert available(MTTY1) == 23  # still one child
    assert json.loads(run("remove", U1, "--json").output)["action"] == "removed"
    r = run("remove", U1, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["action"] == "unchanged"


def test_a_uuid_in_use_on_another_type_is_refused():
    MdevBus(REAL).create(MTTY, MTTY1, U1)
    r = run("create", MTTY, MTTY2, U1)
    assert r.exit_code == 1
    assert f"that UUID already exists on {MTTY}/{MTTY1}" in r.output
    # The kernel's own refusal (what MdevBus meets when it loses a race): EEXIST.
    with pytest.raises(OSError) as e:
        KernelWriter().write(MTTY_DIR / "mdev_supported_types" / MTTY2 / "create", U1)
    assert e.value.errno == errno.EEXIST
    assert MdevBus(REAL).device(U1).type_id == MTTY1  # untouched


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

    MdevBus(REAL).create(MTTY, MTTY1, U1)
    with pytest.raises(MdevUuidInUseError) as e:
        LateBus(REAL).create(MTTY, MTTY2, U1)
    assert MTTY1 in str(e.value)
    assert LateBus(REAL).create(MTTY, MTTY1, U1).uuid == U1  # the same type: it is ours


def test_no_instances_left_is_the_kernels_refusal():
    bus = MdevBus(REAL)
    made = [bus.create(MTTY, MTTY2, f"83b8f4f2-509f-382f-3c1e-e6bfe0fa2{i:03d}") for i in range(12)]
    assert available(MTTY2) == 0 and available(MTTY1) == 0
    with pytest.raises(MdevNoInstancesError) as e:
        bus.create(MTTY, MTTY1, U1)
    assert MTTY in str(e.value) and MTTY1 in str(e.value)
    r = run("create", MTTY, MTTY2, U2)
    assert r.exit_code == 1 and f"{MTTY} has no {MTTY2} instances left" in r.output, r.output
    assert len(made) == 12 and bus.device(U1) is None and bus.device(U2) is None


def test_a_malformed_uuid_never_reaches_the_kernel_which_would_refuse_it():
    r = run("create", MTTY, MTTY1, "not-a-uuid")
    assert r.exit_code == 1 and "not-a-uuid" in r.output, r.output
    with pytest.raises(OSError) as e:
        KernelWriter().write(MTTY_DIR / "mdev_supported_types" / MTTY1 / "create", "not-a-uuid")
    assert e.value.errno == errno.EINVAL
    assert MdevBus(REAL).devices() == []
