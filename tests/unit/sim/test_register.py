"""The simulated lenders' register (``vmlend.sim.register``): per device, the newest fencing
token and the borrow it serves, written with the SmartIO driver's rules (docs/smartio-contract.md
§4): a newer token wins, an older one is refused with nothing changed, a take-back with an old
fence token is refused, a release clears the borrower. And the sim backend with a register:
each step on a device for a hold tells it, and nothing changes without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.daemon_marks import REGISTRIES
from tests.support.simfabric import make_fabric
from vmlend.errors import StaleTokenError
from vmlend.registry import FenceRecord
from vmlend.sim.backend import SimFabric
from vmlend.sim.register import LENDERS_ENV, LenderRegister, Serving
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import open_fabric

GPU = 0x10
G1, B1 = "gamma/g1", "beta/b1"
VM1 = Holder("gamma", "vm1", "11111111-1111-1111-1111-111111111111")
VM2 = Holder("gamma", "vm2", "22222222-2222-2222-2222-222222222222")
U1 = "aaaaaaaa-0000-0000-0000-000000000001"
U2 = "aaaaaaaa-0000-0000-0000-000000000002"


@pytest.fixture
def reg(tmp_path: Path) -> LenderRegister:
    return LenderRegister(tmp_path / "lenders")


# --- the register's rules ---------------------------------------------------------------------
def test_a_device_never_given_a_token_serves_nobody(reg):
    assert reg.read(GPU) == Serving(GPU, 0, "")
    assert reg.all() == {}


def test_a_newer_token_wins(reg):
    reg.serve(GPU, 5, G1)
    assert reg.read(GPU) == Serving(GPU, 5, G1)
    # g1's hold ended and the lender took the device back; b1's newer hold creates its mdev
    assert reg.serve(GPU, 7, B1) == Serving(GPU, 7, B1)
    assert reg.read(GPU) == Serving(GPU, 7, B1)
    assert reg.all() == {GPU: Serving(GPU, 7, B1)}
    # the same hold again (a re-run of the prepare): the same, not refused
    assert reg.serve(GPU, 7, B1) == Serving(GPU, 7, B1)


def test_an_older_token_is_refused_with_nothing_changed(reg):
    reg.serve(GPU, 7, B1)
    # g1's hook, frozen past its lease, goes on: its mdev creation carries its ended hold's token
    with pytest.raises(StaleTokenError, match=r"fencing token 5\) refused.*token 7"):
        reg.serve(GPU, 5, G1)
    assert reg.read(GPU) == Serving(GPU, 7, B1)
    # and after b1's release too: the device has served token 7, so 5 is still too old
    assert reg.end(GPU, B1, 7)
    with pytest.raises(StaleTokenError):
        reg.serve(GPU, 5, G1)
    assert reg.read(GPU) == Serving(GPU, 7, "")


def test_a_take_back_with_an_old_fence_token_is_refused(reg):
    reg.serve(GPU, 7, B1)
    # a late take-back for g1's fence (token 5): b1's borrow is not its to end
    with pytest.raises(StaleTokenError, match=r"take-back for an ended hold \(fencing token 5\)"):
        reg.take_back(GPU, 5)
    assert reg.read(GPU) == Serving(GPU, 7, B1)
    # the take-back for b1's own fence resets the device: it serves nobody, token kept
    assert reg.take_back(GPU, 7) == Serving(GPU, 7, "", retired=7)
    assert reg.read(GPU) == Serving(GPU, 7, "", retired=7)
    # and an older hold's mdev creation is refused after it as well
    with pytest.raises(StaleTokenError):
        reg.serve(GPU, 5, G1)


def test_a_take_back_makes_the_fences_token_the_devices_newest(reg):
    reg.serve(GPU, 5, G1)
    # b1's hold (token 9) ended before it made its mdev; its fence's take-back still resets
    # the device up to token 9, so a hold older than b1's (token 7) is refused after it
    assert reg.take_back(GPU, 9) == Serving(GPU, 9, "", retired=9)
    with pytest.raises(StaleTokenError):
        reg.serve(GPU, 7, "alpha/a1")
    assert reg.read(GPU) == Serving(GPU, 9, "", retired=9)


def test_the_token_a_device_was_taken_back_for_is_spent(reg):
    """Found by the protocol model (take-back-forgets-token): b1's hold ended, the lender took
    the device back for it, and no newer hold came yet; b1's host, cut off, still believes in
    its hold and makes its mdev again with the same token. The device must refuse it, although
    the token is still its newest."""
    reg.serve(GPU, 7, B1)
    reg.take_back(GPU, 7)
    with pytest.raises(StaleTokenError):
        reg.serve(GPU, 7, B1)
    assert reg.read(GPU) == Serving(GPU, 7, "", retired=7)
    # the next hold (a newer token) is served as before
    assert reg.serve(GPU, 8, G1) == Serving(GPU, 8, G1, retired=7)


def test_a_release_clears_the_borrower_and_keeps_the_token(reg):
    reg.serve(GPU, 7, B1)
    # neither another borrower's release, nor one of an older hold of the same VM, ends it
    assert not reg.end(GPU, G1, 7)
    assert not reg.end(GPU, B1, 5)
    assert reg.read(GPU) == Serving(GPU, 7, B1)
    assert reg.end(GPU, B1, 7)
    assert reg.read(GPU) == Serving(GPU, 7, "")
    # the removal of the holder's mdev whose hold is gone (no token known) clears it too
    reg.serve(GPU, 9, G1)
    assert reg.end(GPU, G1)
    assert reg.read(GPU) == Serving(GPU, 9, "")


def test_a_release_spends_the_holds_token_served_yet_or_not(reg):
    """Found by the nemesis (seed 4): a win-back read b2's hold (token 7) and, before it made
    the mdev, a CLI call released that hold. The release must spend 7 even though the device
    did not serve it yet, so the late mdev creation is refused."""
    reg.serve(GPU, 5, G1)
    reg.end(GPU, G1, 5, spend=True)
    assert not reg.end(GPU, B1, 7, spend=True)  # not served yet: nothing to clear
    assert reg.read(GPU) == Serving(GPU, 5, "", retired=7)
    with pytest.raises(StaleTokenError):
        reg.serve(GPU, 7, B1)
    assert reg.serve(GPU, 8, G1) == Serving(GPU, 8, G1, retired=7)
    # spending an older hold's token leaves the newer borrow alone
    assert not reg.end(GPU, B1, 7, spend=True)
    assert reg.read(GPU) == Serving(GPU, 8, G1, retired=7)


def test_a_file_is_replaced_whole(reg):
    reg.serve(GPU, 5, G1)
    reg.serve(GPU, 7, B1)
    names = sorted(p.name for p in reg.directory.iterdir())
    assert names == ["0x10.json", "0x10.lock", "history.log"]  # no temporary file left behind


# --- the sim backend with a register ------------------------------------------------------------
@pytest.fixture(params=REGISTRIES)
def location(request, tmp_path):
    """An SQLite file, or a cluster prefix on a real etcd (where the nemesis runs)."""
    if request.param == "etcd":
        return request.getfixturevalue("etcd_url")
    return tmp_path / "state.db"


@pytest.fixture
def fab(location, reg: LenderRegister):
    f = make_fabric(location)
    f.lenders = reg
    yield f
    f.close()


def _take(f: SimFabric, holder: Holder, uuid: str) -> int:
    f.reserve(GPU, holder)
    f.ensure_mdev_parent(GPU)
    f.create_mdev(GPU, uuid, holder)
    return f.holds()[GPU].token


def test_the_sim_backend_tells_the_register_of_each_step(fab, reg):
    t1 = _take(fab, VM1, U1)
    assert t1 > 0 and reg.read(GPU) == Serving(GPU, t1, "gamma/vm1")
    assert fab.remove_mdev(U1)  # the holder's mdev removed: the device serves nobody
    assert reg.read(GPU) == Serving(GPU, t1, "")
    fab.create_mdev(GPU, U1, VM1)
    assert reg.read(GPU) == Serving(GPU, t1, "gamma/vm1")
    fab.remove_mdev(U1)
    assert fab.release(GPU, VM1)  # the hold ends: its token is spent
    assert reg.read(GPU) == Serving(GPU, t1, "", retired=t1)
    t2 = _take(fab, VM2, U2)
    assert t2 > t1 and reg.read(GPU) == Serving(GPU, t2, "gamma/vm2", retired=t1)
    # vm1's release now is not vm2's: the device goes on serving vm2
    assert not fab.release(GPU, VM1)
    assert reg.read(GPU) == Serving(GPU, t2, "gamma/vm2", retired=t1)
    assert fab.release(GPU, VM2)  # a release without the mdev removed first clears it too
    assert reg.read(GPU) == Serving(GPU, t2, "", retired=t2)


def test_an_mdev_made_for_a_hold_another_process_released_meanwhile_is_refused(
    fab, reg, location
):
    """The nemesis's seed 4: this process checked the hold and recorded the child; another
    process (a CLI call) released the hold before this one told the device. The device must
    not serve the ended hold, and no child record is left."""
    other = make_fabric(location)
    other.lenders = reg
    try:
        fab.reserve(GPU, VM1)
        fab.ensure_mdev_parent(GPU)
        token = fab.holds()[GPU].token
        read_hold = fab._hold

        def hold_then_release(fdid: int):
            hold = read_hold(fdid)
            assert other.release(GPU, VM1)  # between the read and the device's write
            return hold

        fab._hold = hold_then_release  # type: ignore[method-assign]
        with pytest.raises(StaleTokenError):
            fab.create_mdev(GPU, U1, VM1)
    finally:
        other.close()
    assert fab.mdevs() == [] and fab.holds() == {}
    assert reg.read(GPU) == Serving(GPU, 0, "", retired=token)


def test_the_sim_backend_refuses_an_mdev_for_a_token_older_than_the_devices(fab, reg):
    fab.reserve(GPU, VM1)
    fab.ensure_mdev_parent(GPU)
    t1 = fab.holds()[GPU].token
    reg.serve(GPU, t1 + 100, "beta/b1")  # the device has served a newer hold meanwhile
    with pytest.raises(StaleTokenError):
        fab.create_mdev(GPU, U1, VM1)
    assert fab.mdevs() == []  # the record this call made is undone
    assert reg.read(GPU) == Serving(GPU, t1 + 100, "beta/b1")


def test_the_sim_backend_refuses_a_take_back_with_an_old_fence_token(fab, reg):
    reg.serve(GPU, 7, "beta/b1")
    assert not fab.take_back(FenceRecord(GPU, VM1, 5))
    assert reg.read(GPU) == Serving(GPU, 7, "beta/b1")
    fab.take_back(FenceRecord(GPU, Holder("beta", "b1", ""), 7))
    assert reg.read(GPU) == Serving(GPU, 7, "", retired=7)


def test_no_register_unless_the_environment_names_one(tmp_path, monkeypatch):
    make_fabric(tmp_path / "state.db").close()
    monkeypatch.delenv(LENDERS_ENV, raising=False)
    with open_fabric(tmp_path / "state.db", "gamma") as f:
        assert isinstance(f, SimFabric) and f.lenders is None
        _take(f, VM1, U1)
    monkeypatch.setenv(LENDERS_ENV, str(tmp_path / "lenders"))
    with open_fabric(tmp_path / "state.db", "gamma") as f:
        assert isinstance(f, SimFabric) and f.lenders is not None
        assert f.lenders.directory == tmp_path / "lenders"
    assert not (tmp_path / "lenders" / "0x10.json").exists()  # the first fabric wrote none


def test_a_release_that_spent_the_token_but_did_not_land_gives_the_vm_a_new_hold(fab, reg):
    """The release spends the token at the device first; then the registry fails (etcd
    away) and the hold stays. The VM's next reserve of the device (a live migration rolling
    back, an attach after a failed detach) must not reuse the dead hold, whose every step the
    device refuses: it ends it and takes a new token."""
    from vmlend.errors import RegistryUnreachableError

    t1 = _take(fab, VM1, U1)
    fab.remove_mdev(U1)
    transact = fab._reg.transact

    def unreachable(body):
        raise RegistryUnreachableError("127.0.0.1:1", "etcd at 127.0.0.1:1 does not answer")

    fab._reg.transact = unreachable  # type: ignore[method-assign]
    with pytest.raises(RegistryUnreachableError):
        fab.release(GPU, VM1)
    fab._reg.transact = transact  # type: ignore[method-assign]
    assert fab.holds()[GPU].token == t1 and reg.read(GPU).retired == t1  # the dead hold
    made = fab.reserve(GPU, VM1)
    assert made.created and fab.holds()[GPU].token > t1
    fab.ensure_mdev_parent(GPU)
    fab.create_mdev(GPU, U1, VM1)  # served under the new token
    assert reg.read(GPU) == Serving(GPU, fab.holds()[GPU].token, "gamma/vm1", retired=t1)
