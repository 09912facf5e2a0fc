"""``devices(lender)``: one lender's devices, read alone from the registry (issue 38: at
1,024 nodes reading every device record to list one lender's cost ~4x the rest of the
command), with the states and holders the whole listing gives them."""

from __future__ import annotations

import sqlite3

import pytest

from tests.support.daemon_marks import REGISTRIES
from tests.support.simfabric import make_fabric
from vmlend.errors import StateRecordError, UnknownNodeError
from vmlend.registry import open_registry
from vmlend.topology.model import Holder

VM = Holder("gamma", "vm1", "11111111-1111-1111-1111-111111111111")


@pytest.fixture(params=REGISTRIES)
def location(request, tmp_path):
    if request.param == "etcd":
        return request.getfixturevalue("etcd_url")
    return tmp_path / "state.db"


def test_one_lenders_devices_are_what_the_whole_listing_says_of_them(location):
    fab = make_fabric(location)
    try:
        fab.reserve(0x10, VM)
        fab.unlend(0x11)
        fab.set_node_up("beta", False, "maintenance")
        every = fab.devices()
        for node in ("alpha", "beta", "gamma"):
            assert fab.devices(node) == [st for st in every if st.spec.lender == node], node
        assert [st.fdid for st in fab.devices("alpha")] == [0x10, 0x11, 0x12]
        with pytest.raises(UnknownNodeError):
            fab.devices("nowhere")
    finally:
        fab.close()


def test_the_registry_returns_the_records_asked_for_and_no_other(location):
    make_fabric(location).close()
    with open_registry(location) as reg, reg.read() as tx:
        every = tx.devices()
        assert tx.devices([0x10, 0x21, 0x999]) == {f: every[f] for f in (0x10, 0x21)}
        assert tx.devices([]) == {}


def test_another_lenders_damaged_record_does_not_stop_one_lenders_listing(tmp_path):
    # Behaviour only a listing that reads one lender's records has: the whole listing reads
    # beta's damaged row and fails; alpha's does not read it.
    path = tmp_path / "state.db"
    make_fabric(path).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE devices SET lent = 'yes' WHERE fdid = 0x20")
    fab = make_fabric(path)
    try:
        with pytest.raises(StateRecordError, match="device record 0x20"):
            fab.devices()
        assert [st.fdid for st in fab.devices("alpha")] == [0x10, 0x11, 0x12]
    finally:
        fab.close()
