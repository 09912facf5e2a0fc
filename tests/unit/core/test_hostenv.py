from pathlib import Path

from vmlend.hostenv import HostEnv


def test_root_precedence(tmp_path):
    assert HostEnv.from_env(tmp_path, {"VMLEND_ROOT": "/elsewhere"}).root == tmp_path
    assert HostEnv.from_env(None, {"VMLEND_ROOT": str(tmp_path)}).root == tmp_path
    assert HostEnv.from_env(None, {}).root == Path("/")
    assert HostEnv.from_env(None, {"VMLEND_ROOT": ""}).root == Path("/")


def test_every_path_hangs_off_the_root(tmp_path):
    env = HostEnv(tmp_path)
    paths = [
        env.sys, env.dev, env.etc, env.run, env.proc, env.mdev_bus, env.mdev_devices,
        env.iommu_groups, env.iommu_class, env.module("vfio"), env.smartio, env.vfio_container,
        env.libvirt_hooks, env.process(1), *env.libvirtd_pidfiles,
    ]  # fmt: skip
    assert all(p.is_relative_to(tmp_path) for p in paths)
    assert env.mdev_devices == tmp_path / "sys/bus/mdev/devices"


def test_is_real(tmp_path):
    assert HostEnv().is_real
    assert not HostEnv(tmp_path).is_real
