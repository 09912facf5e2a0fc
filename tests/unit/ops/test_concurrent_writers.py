"""Two writers of one VM's vmlend metadata at once: an attach or a detach, and another (the
agent's lost-lease recovery unplugging a device, or another CLI). Each writes the metadata as
it is when it writes, with its own change, never the copy it read before a long wait."""

from __future__ import annotations

from tests.support.cli_cluster import SimCluster
from vmlend.domain import read_domain
from vmlend.ops.attach import apply_attach, plan_attach
from vmlend.ops.detach import detach
from vmlend.sim.hypervisor.node import SimHypervisor


def _devices(hv: SimHypervisor, vm: str) -> list[int]:
    return [d.fdid for d in read_domain(hv.xml(vm)).devices]  # strict: consistent too


def test_an_attach_does_not_bring_back_a_device_unplugged_while_it_waited(cluster: SimCluster):
    """Found by the nemesis test: beta's agent hot-unplugged b1's lost device 0x10 while a
    `vmlend attach b1 0x11 --live`, planned before, waited for etcd; the attach then wrote its
    planned metadata, 0x10 included. b1's live XML named 0x10 with no hostdev for it, while
    gamma's g1 held and used 0x10."""
    cluster.define("gamma", "vm1", [0x10, 0x11], running=True)
    hv = cluster.hv("gamma")
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x21, live=True, config=False)
        # meanwhile another writer takes 0x10 out of the running VM
        detach(hv, f, "vm1", 0x10, live=True, config=False, progress=lambda _m: None)
        apply_attach(hv, f, plan, lambda _m: None)
    assert _devices(hv, "vm1") == [0x11, 0x21]


def test_a_detach_does_not_bring_back_a_device_removed_while_it_unplugged(
    cluster: SimCluster,
):
    """The same for a detach: it read the XML, then unplugged and waited for the guest."""
    cluster.define("gamma", "vm1", [0x10, 0x11], running=True)
    hv = cluster.hv("gamma")

    class OtherWriterMeanwhile(SimHypervisor):
        """Between the detach's read of the XML and its unplug of 0x11, another writer takes
        0x10 out (as the agent's recovery would)."""

        other_done = False

        def detach_device(self, name, device_xml, live, config):
            if not OtherWriterMeanwhile.other_done:
                OtherWriterMeanwhile.other_done = True
                with cluster.fabric() as g:
                    detach(hv, g, "vm1", 0x10, live=True, config=False, progress=lambda _m: None)
            super().detach_device(name, device_xml, live, config)

    slow = OtherWriterMeanwhile("gamma", hv.store.data_dir, None)
    with cluster.fabric() as f:
        detach(slow, f, "vm1", 0x11, live=True, config=False, progress=lambda _m: None)
    assert _devices(hv, "vm1") == []
    assert cluster.holds() == {}


def test_a_hot_plug_that_lands_after_its_hold_ended_is_undone(cluster: SimCluster):
    """The attach read its hold just before the hot-plug, but the hot-plug hung past the lease
    the hold was on, and the lender gave the device to beta's db meanwhile. The agent's
    recovery could not know (the metadata is written after the hot-plug): the attach itself
    looks again once the device is in, and takes it out."""
    import pytest

    from tests.support.cluster_hosts import DB
    from vmlend.domain import DomainDocument
    from vmlend.domain.model import DomainXML
    from vmlend.errors import FabricError

    cluster.define("gamma", "vm1", [0x10], running=True)
    hv = cluster.hv("gamma")
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x21, live=True, config=False)

        class HoldEndsMeanwhile(SimHypervisor):
            def attach_device(self, name, device_xml, live, config):
                with cluster.fabric() as g:  # the lease ended; the lender lent it again
                    g.release(0x21, plan.holder)
                    g.reserve(0x21, DB)
                super().attach_device(name, device_xml, live, config)

        slow = HoldEndsMeanwhile("gamma", hv.store.data_dir, None)
        with pytest.raises(FabricError) as e:
            apply_attach(slow, f, plan, lambda _m: None)
    assert "its hold ended meanwhile" in str(e.value) and "held by beta/db" in str(e.value)
    assert _devices(hv, "vm1") == [0x10]
    doc = DomainDocument.parse(hv.xml("vm1"), source="live XML")
    plugged = {str(h.uuid) for h in DomainXML(doc.root).mdev_hostdevs()}
    assert str(plan.device.mdev) not in plugged  # the hot-plug was undone
    with cluster.fabric() as f:
        assert f.device(0x21).holder == DB  # and db's hold left alone


def test_an_undone_attach_does_not_bring_back_a_device_unplugged_while_it_ran(
    cluster: SimCluster,
):
    """Found by the nemesis test (seed 71): `vmlend attach a1 0x21 --live` was frozen after
    writing its metadata; alpha's agent, back from a restart, hot-unplugged a1's lost device
    0x20 and took it out of the metadata; the attach went on, found its own hold ended and
    undid itself by writing back the metadata it had read before its write, 0x20 included.
    a1's live XML named 0x20 with no hostdev for it while gamma's g2 held and used 0x20. An
    undo takes only its own device out of the metadata as it is then."""
    import pytest

    from tests.support.cluster_hosts import DB
    from vmlend.errors import FabricError

    cluster.define("gamma", "vm1", [0x10], running=True)
    hv = cluster.hv("gamma")
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x21, live=True, config=False)

        class OthersMeanwhile(SimHypervisor):
            done = False

            def set_metadata(self, name, uri, key, metadata, live, config):
                super().set_metadata(name, uri, key, metadata, live, config)
                if not OthersMeanwhile.done:  # the attach's own write, not its undo
                    OthersMeanwhile.done = True
                    with cluster.fabric() as g:  # the agent's recovery, and the lease's end
                        detach(hv, g, "vm1", 0x10, live=True, config=False, progress=str)
                        g.release(0x21, plan.holder)
                        g.reserve(0x21, DB)

        slow = OthersMeanwhile("gamma", hv.store.data_dir, None)
        with pytest.raises(FabricError, match="its hold ended meanwhile"):
            apply_attach(slow, f, plan, lambda _m: None)
    assert _devices(hv, "vm1") == []
