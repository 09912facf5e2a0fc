"""The registry's records (``vmlend.registry.records``): who a holder is."""

from __future__ import annotations

from vmlend.registry.records import same_holder
from vmlend.topology.model import Holder

U = "11111111-1111-1111-1111-111111111111"


def test_a_holder_is_a_vm_on_a_node():
    here = Holder("gamma", "vm1", U)
    assert same_holder(here, Holder("gamma", "renamed", U))  # the UUID decides
    assert not same_holder(here, Holder("gamma", "vm1", "22222222-2222-2222-2222-222222222222"))
    assert same_holder(here, Holder("gamma", "vm1"))  # no UUID on one side: the name decides
    # the same VM (name and UUID) on another node is another holder: a live migration's
    # destination is not the source's hold
    assert not same_holder(here, Holder("beta", "vm1", U))
    assert not same_holder(Holder("gamma", "vm1"), Holder("beta", "vm1"))
