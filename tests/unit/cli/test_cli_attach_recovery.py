"""``vmlend attach`` / ``detach`` when things go wrong half-way: libvirt's asynchronous live
detach (the guest lets go late, or never), a detach interrupted after libvirt unplugged the
hostdev, and Ctrl-C during an attach."""

from __future__ import annotations

import pytest

from tests.support.cli_cluster import (
    GAMMA,
    MetadataFails,
    SimCluster,
    hostdev_uuids,
    metadata_fdids,
)
from vmlend.domain import DomainDocument, find_device
from vmlend.errors import DetachTimeoutError, FabricError
from vmlend.ops.attach import apply_attach, plan_attach
from vmlend.ops.definitions import hostdev_xml
from vmlend.ops.detach import detach
from vmlend.ops.unplug import DetachWait


class FakeClock:
    """Time that passes only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def quick_wait(timeout: float = 2.0) -> DetachWait:
    clock = FakeClock()
    return DetachWait(timeout=timeout, interval=0.5, clock=clock, sleep=clock.sleep)


class AsyncDetachHv:
    """libvirt with QEMU: a live detach only asks the guest; the hostdev leaves the live XML
    once the guest acknowledges, here after ``acks_after`` reads of the live XML (None: a guest
    with no OS, which never does)."""

    def __init__(self, hv, acks_after: int | None = None) -> None:
        self._hv = hv
        self.acks_after = acks_after
        self.pending: list[tuple[str, bytes]] = []
        self.reads = 0

    def __getattr__(self, name):
        return getattr(self._hv, name)

    def detach_device(self, name, device_xml, live, config):
        if config:
            self._hv.detach_device(name, device_xml, live=False, config=True)
        if live:
            self.pending.append((name, device_xml))

    def acknowledge(self) -> None:
        for name, dev in self.pending:
            self._hv.detach_device(name, dev, live=True, config=False)
        self.pending.clear()

    def xml(self, name, inactive=False):
        if not inactive and self.pending:
            self.reads += 1
            if self.acks_after is not None and self.reads > self.acks_after:
                self.acknowledge()
        return self._hv.xml(name, inactive)


def attached(cluster: SimCluster, fdid: int = 0x10) -> str:
    """Attach ``fdid`` live to a running vm1; its mdev UUID."""
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli("attach", "vm1", hex(fdid), *GAMMA)
    assert r.exit_code == 0, r.output
    return hostdev_uuids(cluster.hv("gamma").xml("vm1"))[0]


# --- asynchronous live detach ----------------------------------------------------------------


def test_live_detach_waits_until_the_guest_releases_the_hostdev(cluster):
    mdev = attached(cluster)
    hv = AsyncDetachHv(cluster.hv("gamma"), acks_after=3)
    with cluster.fabric() as f:
        res = detach(
            hv,
            f,
            "vm1",
            0x10,
            live=False,
            config=False,
            progress=lambda _m: None,
            wait=quick_wait(),
        )
    assert res.returned and hv.reads > 3
    assert cluster.holds() == {} and cluster.mdevs() == set()
    assert mdev not in hostdev_uuids(cluster.hv("gamma").xml("vm1"))


def test_a_guest_that_never_releases_the_hostdev_keeps_hold_and_mdev(cluster):
    mdev = attached(cluster)
    hv = AsyncDetachHv(cluster.hv("gamma"))
    with cluster.fabric() as f, pytest.raises(DetachTimeoutError) as e:
        detach(
            hv,
            f,
            "vm1",
            0x10,
            live=False,
            config=False,
            progress=lambda _m: None,
            wait=quick_wait(),
        )
    msg = str(e.value)
    assert "\n" not in msg
    assert "still attached" in msg and "did not release it" in msg
    assert "re-run 'vmlend detach vm1 0x10'" in msg
    # Nothing the guest may still use was taken away.
    assert cluster.holds() == {0x10: "gamma/vm1"} and cluster.mdevs() == {(mdev, 0x10)}
    live = cluster.hv("gamma").xml("vm1")
    assert hostdev_uuids(live) == [mdev] and metadata_fdids(live) == ["0x10"]
    # The guest lets go later: the re-run the message asks for finishes the job.
    hv.acknowledge()
    r = cluster.cli("detach", "vm1", "0x10", *GAMMA)
    assert r.exit_code == 0, r.output
    assert cluster.holds() == {} and cluster.mdevs() == set()
    assert metadata_fdids(cluster.hv("gamma").xml("vm1")) == []


def test_bad_wait_settings_are_refused():
    with pytest.raises(ValueError):
        DetachWait(timeout=-1)
    with pytest.raises(ValueError):
        DetachWait(interval=0)


def test_attach_rollback_waits_for_the_unplug_and_keeps_the_device_while_plugged(cluster):
    cluster.define("gamma", "vm1", running=True)
    hv = AsyncDetachHv(MetadataFails(cluster.hv("gamma")))
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x10, live=True, config=False)
        with pytest.raises(FabricError) as e:
            apply_attach(hv, f, plan, lambda _m: None, wait=quick_wait())
    msg = str(e.value)
    assert "\n" not in msg and "metadata refused" in msg
    assert "could not undo" in msg and "still attached" in msg
    mdev = str(plan.device.mdev)
    # The hostdev is still in the guest: its reservation and mdev stay.
    assert hostdev_uuids(cluster.hv("gamma").xml("vm1")) == [mdev]
    assert cluster.holds() == {0x10: "gamma/vm1"} and cluster.mdevs() == {(mdev, 0x10)}
    # The re-run the message asks for unplugs the hostdev the metadata no longer names, then
    # returns the device (here the guest answers this time).
    hv = AsyncDetachHv(cluster.hv("gamma"), acks_after=0)
    with cluster.fabric() as f:
        res = detach(hv, f, "vm1", 0x10, live=False, config=False, progress=lambda _m: None)
    assert res.returned and hv.reads == 1
    assert hostdev_uuids(cluster.hv("gamma").xml("vm1")) == []
    assert cluster.holds() == {} and cluster.mdevs() == set()


def test_attach_rollback_returns_the_device_once_the_guest_let_go(cluster):
    cluster.define("gamma", "vm1", running=True)
    before = cluster.snapshot()
    hv = AsyncDetachHv(MetadataFails(cluster.hv("gamma")), acks_after=2)
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x10, live=True, config=False)
        with pytest.raises(FabricError, match="metadata refused; nothing was changed"):
            apply_attach(hv, f, plan, lambda _m: None, wait=quick_wait())
    assert cluster.snapshot() == before


# --- interrupted detach ----------------------------------------------------------------------


def test_detach_interrupted_before_the_metadata_update_can_be_finished(cluster):
    mdev = attached(cluster)
    hv = cluster.hv("gamma")
    doc = DomainDocument.parse(hv.xml("vm1"))
    device = find_device(doc, 0x10)
    assert device is not None
    # libvirt unplugged the hostdev, then the CLI died: the metadata still names the device.
    hv.detach_device("vm1", hostdev_xml(doc, device), live=True, config=False)
    assert metadata_fdids(hv.xml("vm1")) == ["0x10"] and cluster.mdevs() == {(mdev, 0x10)}
    r = cluster.cli("detach", "vm1", "0x10", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "returned to the fabric" in r.stdout
    assert cluster.holds() == {} and cluster.mdevs() == set()
    assert metadata_fdids(hv.xml("vm1")) == []


# --- Ctrl-C ----------------------------------------------------------------------------------


class InterruptedHotplug:
    """The user presses Ctrl-C while libvirt plugs the hostdev."""

    def __init__(self, hv) -> None:
        self._hv = hv

    def __getattr__(self, name):
        return getattr(self._hv, name)

    def attach_device(self, name, device_xml, live, config):
        raise KeyboardInterrupt


def test_ctrl_c_during_attach_undoes_reserve_and_mdev(cluster):
    cluster.define("gamma", "vm1", running=True)
    before = cluster.snapshot()
    hv = InterruptedHotplug(cluster.hv("gamma"))
    steps: list[str] = []
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x10, live=True, config=False)
        with pytest.raises(KeyboardInterrupt):
            apply_attach(hv, f, plan, steps.append)
    assert cluster.snapshot() == before
    assert any(s.startswith("undo reserve 0x10") for s in steps)


def test_detach_waits_as_long_as_its_timeout_says_then_keeps_the_device(cluster, monkeypatch):
    """``--timeout``: a guest whose OS is slow to let go gets more time, a test less; the
    refusal names the time given, and nothing the guest may still use is taken away."""
    import vmlend.cli.cmd_attach as cmd_attach

    mdev = attached(cluster)
    hv = AsyncDetachHv(cluster.hv("gamma"))
    monkeypatch.setattr(cmd_attach, "open_hv", lambda _obj, _uri: hv)
    r = cluster.cli("detach", "vm1", "0x10", "--live", "--timeout", "0.3", *GAMMA)
    assert r.exit_code == 1, r.output
    assert "still attached after 0.3 s" in r.output and r.output.count("\n") == 1, r.output
    assert hv.reads >= 1
    assert cluster.holds() == {0x10: "gamma/vm1"} and cluster.mdevs() == {(mdev, 0x10)}


@pytest.mark.parametrize("bad", ["-1", "nan", "1e400", "soon"])
def test_a_detach_timeout_that_is_not_seconds_is_refused_before_anything(cluster, bad):
    mdev = attached(cluster)
    r = cluster.cli("detach", "vm1", "0x10", "--live", "--timeout", bad, *GAMMA)
    assert r.exit_code == 2 and "--timeout" in r.output, r.output
    assert cluster.holds() == {0x10: "gamma/vm1"} and cluster.mdevs() == {(mdev, 0x10)}
