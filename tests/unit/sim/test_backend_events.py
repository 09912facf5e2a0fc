"""The simulated backend's event log (``$VMLEND_EVENTS``), read by the nemesis's replay
through the protocol model: a release whose end no process noted leaves the model holding a
hold etcd no longer has, and the next reserve of the device is refused as two holders."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.replay import Event, read_events
from tests.support.simfabric import make_fabric
from vmlend.errors import DeviceHeldError, RegistryUnreachableError
from vmlend.events import EVENTS_ENV, EVENTS_FILE
from vmlend.registry.records import ExpectedHold
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import open_fabric

VM = Holder("gamma", "vm1")


def _logging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An event log directory under ``tmp_path``, named in ``$VMLEND_EVENTS`` for the fabrics
    made next (each reads it when made)."""
    events = tmp_path / "events"
    events.mkdir()
    monkeypatch.setenv(EVENTS_ENV, str(events))
    return events


def _outcomes(events: Path) -> list[Event]:
    """The events noted, without the calls' brackets (``-begun``, ``-done``)."""
    return [e for e in read_events(events / EVENTS_FILE)
            if not e.kind.endswith(("-begun", "-done"))]


def test_every_reserve_and_release_call_is_bracketed_even_one_that_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A process killed in a call notes no ``-done``: the replay then takes the call's commit
    as possibly landed unrecorded (seed 20, 2026-11-30: alpha's agent was killed between a
    release's commit and its note). Every call that returns or raises closes its bracket."""
    events = _logging(tmp_path, monkeypatch)
    fabric = make_fabric(tmp_path / "state.db")
    fabric.reserve(0x10, VM)
    token = fabric.holds_of(VM)[0x10].token
    with pytest.raises(DeviceHeldError):
        fabric.reserve(0x10, Holder("gamma", "vm2"))
    assert fabric.release(0x10, VM)
    noted = [(e.kind, e.fields.get("vm"), e.fields.get("token"))
             for e in read_events(events / EVENTS_FILE)]
    assert noted == [
        ("reserve-begun", "vm1", None), ("reserve", "vm1", token), ("reserve-done", None, None),
        ("reserve-begun", "vm2", None), ("reserve-done", None, None),
        ("release-begun", "vm1", token), ("release", "vm1", token), ("release-done", None, None),
    ]
    began = [e.fields["began"] for e in read_events(events / EVENTS_FILE) if "-" in e.kind]
    assert began[0] == began[1] and began[2] == began[3] and began[4] == began[5]
    fabric.close()


@pytest.mark.parametrize("journal_token", [True, False])
def test_a_pending_release_landing_on_a_hold_already_gone_notes_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal_token: bool
):
    """Seen in CI's nemesis (seed 20): a VM's release met etcd without quorum, was recorded
    pending, and its first run had committed and lost the reply. The agent landed it later,
    found the hold gone and noted nothing, so the replay refused the VM's next reserve."""
    events = _logging(tmp_path, monkeypatch)
    state = tmp_path / "state.db"
    fabric = make_fabric(state)
    fabric.reserve(0x10, VM)
    token = fabric.holds_of(VM)[0x10].token
    monkeypatch.delenv(EVENTS_ENV)
    with open_fabric(state, "gamma") as first_run:  # committed; its reply (and note) lost
        assert first_run.release(0x10, VM)
    expected = ExpectedHold(token=token if journal_token else 0, before=1e12)
    assert not fabric.release(0x10, VM, expected=expected)  # the journal lands it
    noted = [(e.kind, e.fields.get("token"), e.fields.get("lost_reply"))
             for e in _outcomes(events)]
    if journal_token:
        assert noted == [("reserve", token, None), ("release", token, True)]
    else:  # no token recorded: nothing to name, and nothing invented
        assert noted == [("reserve", token, None)]
    fabric.close()


def test_a_reserve_that_meets_the_registry_away_notes_that_its_outcome_is_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Seed 78 (2026-11-30): a reserve whose commit landed while etcd was cut off raised and
    noted nothing; its hold ended with the lease and the lender's take-back named a token the
    replay had never seen made."""
    from vmlend.errors import RegistryUnreachableError
    from vmlend.ledger.ledger import Ledger

    fabric = make_fabric(tmp_path / "state.db")
    events = _logging(tmp_path, monkeypatch)  # the fabrics made from here on

    def away(*_a: object, **_k: object) -> None:
        raise RegistryUnreachableError("etcd://x", "etcd does not answer")

    with open_fabric(tmp_path / "state.db", "gamma") as cut:
        monkeypatch.setattr(Ledger, "reserve", away)
        with pytest.raises(RegistryUnreachableError):
            cut.reserve(0x10, VM)
    noted = [(e.kind, e.fields.get("fdid"), e.fields.get("vm"))
             for e in _outcomes(events)]
    assert noted == [("reserve-unknown", 0x10, "vm1")]
    fabric.close()


def test_a_pending_release_landing_after_another_vm_took_the_device_notes_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Seen in a nemesis run (seed 20, 2026-11-30): gamma/g2's release committed and lost its
    reply, alpha/a2 reserved the device, and only then did g2's pending release land: it found
    another VM's hold and noted nothing, so the replay refused a2's reserve as a second
    holder."""
    state = tmp_path / "state.db"
    fabric = make_fabric(state)
    fabric.reserve(0x10, VM)
    token = fabric.holds_of(VM)[0x10].token
    with open_fabric(state, "gamma") as first_run:  # committed; its reply (and note) lost
        assert first_run.release(0x10, VM)
    other = Holder("gamma", "vm2")
    fabric.reserve(0x10, other)
    events = _logging(tmp_path, monkeypatch)  # the fabric landing it from here on
    with open_fabric(state, "gamma") as landing:
        assert not landing.release(0x10, VM, expected=ExpectedHold(token=token, before=1e12))
        assert landing.holds_of(other)[0x10].token > token  # the other VM's hold untouched
    noted = [(e.kind, e.fields.get("vm"), e.fields.get("token"), e.fields.get("lost_reply"))
             for e in _outcomes(events)]
    assert noted == [("release", "vm1", token, True)]
    fabric.close()


def test_a_pending_release_of_a_reserve_whose_reply_was_lost_notes_the_hold_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Seen in CI's nemesis (seed 20, 2026-11-30): a VM's prepare met etcd without quorum
    after its reserve had committed; the reserve raised and noted nothing, the release was
    recorded pending without a token, and the agent landed it on that hold: the replay
    refused the release of a hold it had never seen made."""
    state = tmp_path / "state.db"
    fabric = make_fabric(state)
    with open_fabric(state, "gamma") as lost:  # committed; its reply (and note) lost
        lost.reserve(0x10, VM)
    token = fabric.holds_of(VM)[0x10].token
    events = _logging(tmp_path, monkeypatch)  # the fabric landing it from here on
    with open_fabric(state, "gamma") as landing:
        assert landing.release(0x10, VM, expected=ExpectedHold(before=1e12))
    noted = [(e.kind, e.fields.get("token"), e.fields.get("created"), e.fields.get("lost_reply"))
             for e in _outcomes(events)]
    # the replay takes a reserve not created as this call's own lost reply
    # (tests/unit/sim/test_replay.py), then its release
    assert noted == [("reserve", token, False, None), ("release", token, None, False)]
    fabric.close()


@pytest.mark.daemon
def test_a_reserve_whose_lease_ends_before_the_read_back_notes_its_fences_token(
    etcd_url: str, etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Seen in the nemesis (seed 34, beside busy loops): a hook's reserve committed under its
    host's lease while the agent was dead, etcd expired the lease before the token was read
    back, and the reserve was noted with token 0, which the replay refuses as unknown. The
    fence, written in the same transaction without a lease, still names the token."""
    import json
    import os
    import urllib.request

    from vmlend.hostenv import HostEnv
    from vmlend.ledger.ledger import Ledger
    from vmlend.registry import hostlease

    events = _logging(tmp_path, monkeypatch)
    fabric = make_fabric(etcd_url)
    lease = hostlease.read(hostlease.lease_path(HostEnv(Path(os.environ["VMLEND_ROOT"])))).lease
    commit = Ledger.reserve

    def commit_then_lease_ends(self, *args, **kwargs):
        made = commit(self, *args, **kwargs)
        body = json.dumps({"ID": lease}).encode()
        url = f"http://{etcd.endpoint}/v3/lease/revoke"
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=5):
            pass
        return made

    monkeypatch.setattr(Ledger, "reserve", commit_then_lease_ends)
    fabric.reserve(0x10, VM)
    with fabric.registry.read() as tx:
        assert tx.hold(0x10) is None  # the lease took it
        fence = tx.fence(0x10)
    assert fence is not None and fence.token > 0
    noted = [(e.kind, e.fields.get("token")) for e in _outcomes(events)]
    assert noted == [("reserve", fence.token)]
    fabric.close()


def test_a_reserve_whose_token_cannot_be_read_back_notes_a_hold_of_unknown_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The registry goes away between a reserve's commit and the read of its token for the
    note: the hold exists, so the history must say one may (``reserve-unknown``), or the
    replay refuses its later release ("the hold is None"); and the reserve returns what it
    made, as it does with no event log."""
    events = _logging(tmp_path, monkeypatch)
    fabric = make_fabric(tmp_path / "state.db")

    read_back = fabric._token_read_back
    calls = []

    def away_once(fdid: int, holder: Holder) -> int:
        calls.append(fdid)
        if len(calls) == 1:
            raise RegistryUnreachableError("etcd", "no quorum")
        return read_back(fdid, holder)

    monkeypatch.setattr(fabric, "_token_read_back", away_once)
    made = fabric.reserve(0x10, VM)
    assert made.created and calls == [0x10]
    token = fabric.holds_of(VM)[0x10].token
    assert fabric.release(0x10, VM)
    noted = [(e.kind, e.fields.get("token")) for e in _outcomes(events)]
    assert noted == [("reserve-unknown", None), ("release", token)]
    fabric.close()


def test_a_spent_hold_taken_again_over_a_registry_gone_away_notes_a_hold_of_unknown_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A reserve that finds its VM's hold spent ends it and takes a new one; when that second
    commit meets the registry away (etcd may have applied it), the history must say a hold of
    unknown token may exist, as for a first commit that met it (a review's finding)."""
    from vmlend.ledger.ledger import Ledger

    events = _logging(tmp_path, monkeypatch)
    fabric = make_fabric(tmp_path / "state.db")
    fabric.reserve(0x10, VM)
    token = fabric.holds_of(VM)[0x10].token
    monkeypatch.setattr(fabric, "_hold_is_spent", lambda fdid, holder: True)
    reserve, calls = Ledger.reserve, []

    def away_the_second_time(self, fdid, holder, **kw):  # type: ignore[no-untyped-def]
        calls.append(fdid)
        if len(calls) == 2:
            raise RegistryUnreachableError("etcd", "no quorum")
        return reserve(self, fdid, holder, **kw)

    monkeypatch.setattr(Ledger, "reserve", away_the_second_time)
    with pytest.raises(RegistryUnreachableError):
        fabric.reserve(0x10, VM)
    noted = [(e.kind, e.fields.get("token")) for e in _outcomes(events)]
    assert noted == [("reserve", token), ("release", token), ("reserve-unknown", None)]
    fabric.close()
