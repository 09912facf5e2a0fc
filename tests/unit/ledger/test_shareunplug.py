"""``vmlend.ledger.shareunplug``: the registry side of moving an NVMe share unplugged. The
share keeps its identity through claim, hand-over and finish, is the source's or the
destination's at every commit, and give-back/release undo what a move began; every step
again changes nothing more (a re-run after a kill)."""

from __future__ import annotations

import pytest

from tests.support.simfabric import make_fabric
from vmlend.errors import FabricError
from vmlend.ledger import nvmeshares as ledger
from vmlend.ledger import sharemove, shareunplug
from vmlend.ledger.admission import vm_share
from vmlend.ledger.nvmeshares import SHARE_RECORD
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.topology.model import GiB, Holder

NVME = 0x12
SRC = Holder("gamma", "web", "9b2e0f4c-61d4-4c1e-9a57-8f2d3c1b0a11")
DST = Holder("beta", "web", SRC.vm_uuid)


@pytest.fixture
def reg(state_path):
    f = make_fabric(state_path)
    ledger.lend_shared(f.registry, NVME, drive_geometry(f.topology().device(NVME), 1 << 20))
    ledger.reserve_share(f.registry, NVME, SRC, 1, 4096, guest_ram=1 * GiB)
    yield f.registry
    f.close()


def records(reg) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    with reg.read() as tx:
        return {r.key: r.data for r in tx.runtime(NVME, SHARE_RECORD)}


def identity(data: dict) -> tuple:
    s = data["share"]
    return s["qid_base"], s["lba_offset"], s["blocks"], s["asid"], s["vector_base"]


def test_a_share_moves_keeping_its_identity_and_each_step_again_changes_nothing(reg):
    was = records(reg)[vm_share(SRC)]
    shareunplug.claim(reg, [NVME], SRC, DST, 1 * GiB)
    claimed = records(reg)
    assert set(claimed) == {vm_share(SRC)} and "incoming" in claimed[vm_share(SRC)]
    shareunplug.claim(reg, [NVME], SRC, DST, 1 * GiB)
    assert records(reg) == claimed
    assert shareunplug.hand_over(reg, [NVME], SRC, DST, 0.0) == {NVME: 1}
    moved = records(reg)
    assert set(moved) == {vm_share(DST)}
    assert identity(moved[vm_share(DST)]) == identity(was) and moved[vm_share(DST)]["leaving"]
    assert shareunplug.hand_over(reg, [NVME], SRC, DST, 0.0) == {NVME: 1}
    shareunplug.claim(reg, [NVME], SRC, DST, 1 * GiB)  # a re-run's claim: moved already
    assert records(reg) == moved
    assert shareunplug.finish(reg, [NVME], SRC, DST, 0.0) == {NVME: 1}
    done = records(reg)[vm_share(DST)]
    assert "leaving" not in done and "incoming" not in done
    assert shareunplug.finish(reg, [NVME], SRC, DST, 0.0) == {NVME: 1}


def test_give_back_before_and_after_the_hand_over(reg):
    was = records(reg)[vm_share(SRC)]
    shareunplug.claim(reg, [NVME], SRC, DST, 1 * GiB)
    assert shareunplug.give_back(reg, [NVME], SRC, DST, 0.0) == {}
    assert records(reg) == {vm_share(SRC): was}  # the claim dropped, the same epoch
    shareunplug.claim(reg, [NVME], SRC, DST, 1 * GiB)
    shareunplug.hand_over(reg, [NVME], SRC, DST, 0.0)
    assert shareunplug.give_back(reg, [NVME], SRC, DST, 0.0) == {NVME: 2}
    back = records(reg)[vm_share(SRC)]
    assert identity(back) == identity(was) and back["claims"] == was["claims"]
    assert set(records(reg)) == {vm_share(SRC)}


def test_a_claim_refused_changes_nothing_and_a_stopped_vm_leaves_no_share(reg, monkeypatch):
    before = records(reg)

    def full(*_a, **_k):
        raise FabricError("no room")

    with monkeypatch.context() as m:
        m.setattr(sharemove, "check_share_claims", full)
        with pytest.raises(FabricError, match="share of 0x12: no room"):
            shareunplug.claim(reg, [NVME], SRC, DST, 1 * GiB)
    assert records(reg) == before
    shareunplug.claim(reg, [NVME], SRC, DST, 1 * GiB)
    shareunplug.hand_over(reg, [NVME], SRC, DST, 0.0)
    shareunplug.release(reg, [NVME], SRC, DST)
    assert records(reg) == {}
    with reg.read() as tx:
        assert [c for f, c in tx.claims() if f == NVME and "web" in c.share] == []
