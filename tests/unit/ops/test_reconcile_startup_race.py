"""The agent's start-up reconcile and a VM starting at the same moment (issue 20): the hook's
prepare reserves the VM's devices while the reconcile is looking at the host. Whatever the
interleaving, the starting VM keeps its holds. The interleavings are forced: the VM starts
right after the reconcile has listed the domains."""

from __future__ import annotations

import uuid

from vmlend.agent.reconcile import reconcile_host
from vmlend.domain import mdev_uuid
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.topology.model import Holder


def _starting_after_the_listing(hv, name: str):
    """``hv``, whose next ``list_domains`` starts ``name`` right after it has listed."""
    listed = hv.list_domains

    def list_domains():
        out = listed()
        hv.list_domains = listed
        hv.start(name)  # its prepare hook reserves its devices now
        return out

    hv.list_domains = list_domains
    return hv


def test_a_vm_starting_after_the_listing_keeps_the_holds_its_prepare_made(cluster):
    """Its holds appear after the domains were listed, with the VM not running in that
    listing: the old order (domains, then holds) returned them as a stopped VM's."""
    cluster.define("gamma", "web", [0x10])
    hv = _starting_after_the_listing(cluster.hv("gamma"), "web")
    with cluster.fabric() as fabric:
        lines = reconcile_host(hv, fabric)
    assert lines == []
    assert cluster.holds() == {0x10: "gamma/web"}


def test_a_vm_running_by_the_time_of_the_fix_keeps_its_holds(cluster):
    """Its prepare had reserved before the reconcile looked, and the VM was not active yet
    when the domains were listed (a prepare hook still running elsewhere than in libvirt's
    order): it runs by the time its holds would be returned, so they are kept."""
    vid = uuid.uuid4()
    cluster.define("gamma", "web", [0x10], vm_uuid=vid)
    holder = Holder("gamma", "web", str(vid))
    with cluster.fabric() as f:  # what its prepare did
        acquire_device(f, holder, 0x10, str(mdev_uuid(vid, 0x10)), UndoJournal())
    hv = _starting_after_the_listing(cluster.hv("gamma"), "web")
    with cluster.fabric() as fabric:
        lines = reconcile_host(hv, fabric)
    assert lines == ["hold-of-stopped-vm web: kept, the VM started meanwhile"]
    assert cluster.holds() == {0x10: "gamma/web"}
