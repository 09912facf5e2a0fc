"""A fake host root with everything ``vmlend doctor`` wants (``healthy``), and the checks run
over it by name (``checks``)."""

from __future__ import annotations

import os
import time

from tests.support.fake_sysfs import FakeSmartio, FakeSysfs
from vmlend.doctor import run_checks

PID = 4242


def healthy(root) -> FakeSysfs:
    """A host with everything vmlend wants, libvirtd started after the hook was installed."""
    fake = FakeSysfs(root)
    (fake.env.iommu_groups / "0" / "devices").mkdir(parents=True)
    (fake.env.iommu_class / "dmar0").mkdir(parents=True)
    for m in ("vfio", "vfio_pci", "mdev"):
        fake.env.module(m).mkdir(parents=True)
    fake.env.vfio_container.parent.mkdir(parents=True)
    fake.env.vfio_container.write_text("")
    (fake.env.dev / "kvm").write_text("")
    loads_modules(fake.env)
    smartio = FakeSmartio(fake, node_id=12)
    smartio.add_device(0x12, lender_node_id=4)
    smartio._borrow(0x12)
    fake.smartio = smartio  # type: ignore[attr-defined]
    hook = fake.env.libvirt_hooks / "qemu.d" / "vmlend"
    hook.parent.mkdir(parents=True)
    hook.write_text("#!/usr/bin/python3\n# installed by 'vmlend hook install'\n")
    hook.chmod(0o755)
    past = time.time() - 100
    os.utime(hook, (past, past))
    pidfile = fake.env.libvirtd_pidfiles[0]
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    pidfile.write_text(f"{PID}\n")
    fake.env.process(PID).mkdir(parents=True)
    return fake


def loads_modules(env, release: str = "6.1.0-test") -> None:
    """A kernel that loads modules: /proc/modules and /lib/modules/<its release>."""
    (env.proc / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
    (env.proc / "sys" / "kernel" / "osrelease").write_text(f"{release}\n")
    (env.proc / "modules").write_text("")
    (env.root / "lib" / "modules" / release).mkdir(parents=True, exist_ok=True)


def by_name(findings):
    return {f.name: f for f in findings}


def checks(env, **kw):
    return by_name(run_checks(env, libvirt_version=lambda: "9.0.0", **kw))
