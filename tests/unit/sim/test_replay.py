"""The replay of a recorded history through the protocol's model (``tests/support/replay.py``),
on small hand-written histories: one the model allows, and the ones it must refuse. Each
refusal test asserts the reason, so a checker that accepted everything fails it."""

from __future__ import annotations

from pathlib import Path

from tests.support.replay import Event, event, ordered, read_events, replay
from vmlend.events import EventLog

TTL = 2.0


class History:
    """Events in the order written, each process with its own pid; time by hand."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.t = 0.0

    def at(self, t: float) -> History:
        self.t = t
        return self

    def add(self, kind: str, actor: str = "", pid: int = 1, **fields: object) -> History:
        seq = sum(e.pid == pid for e in self.events)
        self.events.append(event(kind, self.t, actor, pid, seq, **fields))
        return self

    # the agent's lease (pid per node), the test's kills
    def up(self, node: str, lease: int, pid: int | None = None, *, adopted: bool = False
           ) -> History:
        """The test starts ``node``'s agent (``pid``: a restarted one's own), which takes
        ``lease`` (or adopts its lease file's) and moves its records onto it."""
        pid = _pid(node) if pid is None else pid
        self.add("restart", node, pid=99)
        self.t += 0.001  # the agent runs after the test started it
        kind = "lease-adopted" if adopted else "lease-granted"
        self.add(kind, node, pid, lease=lease, ttl=TTL, sent=self.t)
        return self.add("lease-followed", node, pid, lease=lease)

    def renew(self, node: str, lease: int) -> History:
        return self.add("lease-renewed", node, _pid(node), lease=lease, ttl=TTL, sent=self.t)

    def crash(self, node: str) -> History:
        return self.add("crash", node, pid=99, agent=_pid(node))

    # the registry, as a hook's process (pid 10+)
    def reserve(self, who: str, fdid: int, token: int, pid: int = 10) -> History:
        node, vm = who.split("/")
        return self.add("reserve", node, pid, fdid=fdid, node=node, vm=vm, token=token)

    def begin(self, what: str, who: str, fdid: int, pid: int = 10, **more: object) -> History:
        """A reserve's or release's call begins (``began`` the clock's now; ``call=`` its id)."""
        node, vm = who.split("/")
        return self.add(f"{what}-begun", node, pid, fdid=fdid, node=node, vm=vm, began=self.t,
                        **more)

    def done(self, what: str, node: str, began: float, pid: int = 10, **more: object) -> History:
        return self.add(f"{what}-done", node, pid, began=began, **more)

    def killed_in_release(self, who: str, fdid: int, token: int) -> History:
        """``who``'s agent spends ``token``, begins the release, is killed (after its commit,
        before its note)."""
        node = who.split("/")[0]
        self.spend(who, fdid, token).begin("release", who, fdid, pid=_pid(node), token=token)
        self.t += 0.01
        return self.crash(node)

    def release(self, who: str, fdid: int, token: int, pid: int = 10) -> History:
        node, vm = who.split("/")
        return self.add("release", node, pid, fdid=fdid, node=node, vm=vm, token=token)

    # the device: what the register wrote (after) and whether it refused
    def device(self, op: str, fdid: int, asked: str, after: tuple[int, str, int],
               refused: bool = False, pid: int = 10) -> History:
        token, borrower, retired = after
        return self.add(op, "", pid, fdid=fdid, asked=asked, refused=refused, token=token,
                        borrower=borrower, retired=retired)

    def serve(self, who: str, fdid: int, token: int, retired: int = 0) -> History:
        return self.device("serve", fdid, f"{token} {who}", (token, who, retired))

    def spend(self, who: str, fdid: int, token: int) -> History:
        return self.device("end", fdid, f"{token} {who} spend", (token, "", token))

    def take_back(self, fdid: int, token: int) -> History:
        return self.device("take-back", fdid, str(token), (token, "", token), pid=20)


def _pid(node: str) -> int:
    return {"alpha": 1, "beta": 2, "gamma": 3}[node]


def _two_hosts() -> History:
    return History().up("alpha", 0xA1).up("beta", 0xB1)


def _why(h: History) -> str:
    run = replay(h.events, ttl=TTL)
    assert run.refusal is not None, f"the model allowed: {run.summary()}"
    return run.refusal.why


def test_a_history_of_holds_released_and_taken_back_is_allowed():
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5).serve("alpha/a1", 0x10, 5)
    h.at(0.9).renew("alpha", 0xA1).renew("beta", 0xB1)
    h.at(1.0).spend("alpha/a1", 0x10, 5).release("alpha/a1", 0x10, 5)
    h.at(1.2).reserve("beta/b1", 0x10, 6, pid=11).device("serve", 0x10, "6 beta/b1",
                                                          (6, "beta/b1", 5), pid=11)
    h.at(1.3).crash("beta")
    # beta's lease ends no sooner than 0.9 + TTL: its hold goes, its fence stays
    h.at(3.5).take_back(0x10, 6)
    h.at(3.6).renew("alpha", 0xA1).reserve("alpha/a1", 0x10, 7).serve("alpha/a1", 0x10, 7, 6)
    h.at(3.7).add("pause", "alpha", 1, vm="a1").add("resume", "alpha", 1, vm="a1", decided=3.7)
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    assert run.counts["take-back"] == 1 and run.counts["serve"] == 3
    assert run.ended == 1  # beta's lease, which the take-back needed ended


def test_a_keepalive_answered_after_its_lease_ended_gives_no_time():
    """Seed 20 (2026-11-30, the latency nemesis): alpha's keepalive sent at 0.9 was answered
    at 4.0, after beta's lender took a1's device back (the lease had ended at 2.9)."""
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5).serve("alpha/a1", 0x10, 5)
    h.at(0.9)
    sent = h.t
    h.at(3.5).take_back(0x10, 5)
    h.at(4.0).add("lease-renewed", "alpha", 1, lease=0xA1, ttl=TTL, sent=sent)
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    assert run.late_answers == 1 and run.ended == 1
    # an answer that would still give time after the lease's end is refused
    h.at(4.1).add("lease-renewed", "alpha", 1, lease=0xA1, ttl=TTL, sent=3.0)
    assert "is gone" in _why(h)


def test_a_take_back_of_a_hold_whose_reserve_lost_its_reply_is_allowed_after_it_only():
    """Seed 78 (2026-11-30): gamma's reserve met etcd cut off and raised, but its commit had
    landed; the hold (never served) ended with gamma's lease and alpha took the device back
    with a token the history never saw made."""
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5).serve("alpha/a1", 0x10, 5)
    h.at(0.6).spend("alpha/a1", 0x10, 5).release("alpha/a1", 0x10, 5)
    h.at(0.8).add("reserve-unknown", "beta", 11, fdid=0x10, node="beta", vm="b1")
    h.at(0.9).renew("alpha", 0xA1).crash("beta")
    h.at(3.5).take_back(0x10, 9)
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    assert run.lost_replies == 1
    # the same take-back without the reserve whose outcome was unknown: refused
    bare = History()
    bare.events = [e for e in h.events if e.kind != "reserve-unknown"]
    assert "a token no reserve made" in _why(bare)
    # unless that reserve's own event comes after it (its answer came late; its read-back
    # found neither hold nor fence: token 0)
    late = History()
    late.events = list(bare.events)
    late.at(3.9).add("reserve", "beta", 12, fdid=0x10, node="beta", vm="b1", token=0, began=0.8)
    run = replay(late.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    # and one of a token older than a hold the history knows: refused
    h.at(3.6).renew("alpha", 0xA1).reserve("alpha/a1", 0x10, 12)
    h.at(3.7).add("reserve-unknown", "beta", 11, fdid=0x10, node="beta", vm="b1")
    h.at(3.8).spend("alpha/a1", 0x10, 12).release("alpha/a1", 0x10, 12)
    h.at(6.0).take_back(0x10, 11)
    assert "the fence's is None" in _why(h)


def test_what_a_lost_reply_explains_is_bounded_by_when_and_where_it_could_happen():
    """A read-only review's sequences (2026-11-30): each explanation of a commit whose reply
    was lost must not cover what the protocol forbids."""
    # a keepalive whose send says the lease lived until 3.9 cannot excuse a take-back at 3.5
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5).serve("alpha/a1", 0x10, 5)
    h.at(3.5).take_back(0x10, 5)
    h.at(4.0).add("lease-renewed", "alpha", 1, lease=0xA1, ttl=TTL, sent=1.9)
    assert "is gone" in _why(h)
    # a landing of b1's release, its first run never seen, cannot go before a2's reserve
    # made while b1's lease lived
    h = _two_hosts()
    h.at(0.5).reserve("beta/b1", 0x10, 5, pid=11)
    h.at(0.9).renew("alpha", 0xA1).renew("beta", 0xB1)
    h.at(1.0).reserve("alpha/a2", 0x10, 6)
    h.at(1.5).renew("alpha", 0xA1).renew("beta", 0xB1)
    h.at(1.6).add("release", "beta", 11, fdid=0x10, node="beta", vm="b1", token=5,
                  lost_reply=True, landing=True)
    assert "cannot have ended before" in _why(h)
    # a reserve that read back another VM's hold (token 0) is not a lost reply
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5)
    h.at(1.0).add("reserve", "beta", 11, fdid=0x10, node="beta", vm="b1", token=0, began=0.9)
    assert "token is unknown" in _why(h)
    # a take-back of an unknown hold while its host's lease surely lives
    h = _two_hosts()
    h.at(0.8).add("reserve-unknown", "beta", 11, fdid=0x10, node="beta", vm="b1", began=0.8)
    h.at(0.9).renew("alpha", 0xA1).renew("beta", 0xB1)
    h.at(1.0).take_back(0x10, 9)
    assert "a token no reserve made" in _why(h)
    # an unknown reserve whose VM's hold showed up with its token explains nothing else
    h = _two_hosts()
    h.at(0.8).add("reserve-unknown", "beta", 11, fdid=0x10, node="beta", vm="b1", began=0.8)
    h.at(1.0).add("reserve", "beta", 12, fdid=0x10, node="beta", vm="b1", token=9,
                  created=False)
    h.add("release", "beta", 12, fdid=0x10, node="beta", vm="b1", token=9)
    h.at(1.2).crash("beta")
    h.at(5.0).take_back(0x10, 20)
    assert "a token no reserve made" in _why(h)
    # nor one whose call began after the take-back
    h = _two_hosts()
    h.at(0.5).crash("beta")
    h.at(3.0).take_back(0x10, 9)
    h.at(30.0).add("reserve-unknown", "beta", 13, fdid=0x10, node="beta", vm="b3", began=29.9)
    assert "a token no reserve made" in _why(h)


def test_a_serve_of_an_older_token_than_one_served_is_refused():
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5).reserve("beta/b1", 0x11, 6, pid=11)
    h.at(0.6).device("serve", 0x11, "6 beta/b1", (6, "beta/b1", 0), pid=11)
    # a device that let an older token in after a newer one
    h.at(0.7).device("serve", 0x11, "5 alpha/a1", (5, "alpha/a1", 0))
    assert "older than the device's" in _why(h)


def test_a_serve_of_a_taken_back_token_is_refused():
    h = _two_hosts()
    h.at(0.5).reserve("beta/b1", 0x10, 6, pid=11).crash("beta")
    h.at(3.0).take_back(0x10, 6)
    h.at(3.1).device("serve", 0x10, "6 beta/b1", (6, "beta/b1", 6), pid=11)
    assert "token 6 was taken back" in _why(h)


def test_a_serve_of_a_released_token_is_refused():
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5)
    h.at(0.6).spend("alpha/a1", 0x10, 5).release("alpha/a1", 0x10, 5)
    # the seed-4 interleaving: a win-back that read the hold before the release serves it
    h.at(0.7).device("serve", 0x10, "5 alpha/a1", (5, "alpha/a1", 5), pid=1)
    assert "token 5 was taken back" in _why(h)


def test_a_release_that_does_not_spend_its_token_disagrees_with_the_model():
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5).serve("alpha/a1", 0x10, 5)
    h.at(0.6).device("end", 0x10, "5 alpha/a1 spend", (5, "", 0))  # retired left at 0
    assert "the device says token 5, retired 0" in _why(h)


def test_two_holds_on_one_device_without_a_release_or_take_back_are_refused():
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5)
    h.at(1.0).reserve("beta/b1", 0x10, 6, pid=11)
    assert "cannot have ended before" in _why(h)


def test_a_release_whose_agent_was_killed_before_its_note_may_have_landed():
    # seed 20, 2026-11-30: alpha's agent spent a1's token, committed the release and was
    # killed before it noted it; a1's next prepare found no hold
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5, pid=1)
    h.at(0.8).killed_in_release("alpha/a1", 0x10, 5)
    h.at(1.0).reserve("alpha/a1", 0x10, 6, pid=12)
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    assert run.unlogged_releases == 1
    # killed late (restarted after its lease ended): the hold went with the lease, the fence
    # with the release, and a2's reserve finds the device free
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5, pid=1)
    h.at(0.8).killed_in_release("alpha/a1", 0x10, 5)
    h.at(3.8).up("alpha", 0xA2, pid=4)
    h.at(4.0).reserve("alpha/a2", 0x10, 6, pid=12)
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    assert run.unlogged_releases == 1


def test_a_release_begun_explains_nothing_unless_its_agent_was_killed_in_it():
    # the agent lives on: the release's end would have been noted
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5, pid=1)
    h.at(0.8).spend("alpha/a1", 0x10, 5).begin("release", "alpha/a1", 0x10, pid=1, token=5)
    h.at(0.81).crash("beta")
    h.at(1.0).reserve("beta/b1", 0x10, 6, pid=12)
    assert "cannot have ended before" in _why(h)
    # the call returned (it found its hold gone, say, and noted nothing), then the kill
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5, pid=1)
    h.at(0.8).spend("alpha/a1", 0x10, 5).begin("release", "alpha/a1", 0x10, pid=1, token=5)
    h.done("release", "alpha", 0.8, pid=1)
    h.at(0.9).crash("alpha")
    h.at(1.0).reserve("beta/b1", 0x10, 6, pid=12)
    assert "cannot have ended before" in _why(h)
    # a reserve that came before the release began
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5, pid=1)
    h.at(0.7).reserve("beta/b1", 0x10, 6, pid=12)
    h.at(0.8).killed_in_release("alpha/a1", 0x10, 5)
    assert "cannot have ended before" in _why(h)
    # a release that spent no token could not end the hold (its expected hold was another)
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5, pid=1)
    h.at(0.8).begin("release", "alpha/a1", 0x10, pid=1, token=5)
    h.at(0.81).crash("alpha")
    h.at(1.0).reserve("beta/b1", 0x10, 6, pid=11)
    assert "cannot have ended before" in _why(h)
    # the hold showed up alive after the kill: the release did not land
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5, pid=1)
    h.at(0.8).killed_in_release("alpha/a1", 0x10, 5)
    h.at(0.9).up("alpha", 0xA1, pid=4, adopted=True)
    h.at(1.0).add("reserve", "alpha", 12, fdid=0x10, node="alpha", vm="a1", token=5,
                  created=False)
    h.at(1.2).reserve("beta/b1", 0x10, 6, pid=11)
    assert "cannot have ended before" in _why(h)


def test_calls_are_told_apart_by_their_ids_not_their_clock_readings():
    # two threads of alpha's agent begin releases at one clock reading; a2's returns, a1's
    # is cut short after its commit
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5, pid=1).reserve("alpha/a2", 0x11, 6, pid=1)
    h.at(0.8).spend("alpha/a2", 0x11, 6).spend("alpha/a1", 0x10, 5)
    h.begin("release", "alpha/a2", 0x11, pid=1, token=6, call="c2")
    h.begin("release", "alpha/a1", 0x10, pid=1, token=5, call="c1")
    h.at(0.805).release("alpha/a2", 0x11, 6, pid=1).done("release", "alpha", 0.8, pid=1,
                                                          call="c2")
    h.at(0.81).crash("alpha")
    h.at(1.0).reserve("beta/b1", 0x10, 7, pid=11)
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()


def test_a_reserve_whose_agent_was_killed_before_its_note_may_have_made_a_hold():
    # its hold (token 7, never noted) is released by the restarted agent's reconcile, after
    # another host's reserve (token 8) of another device
    h = _two_hosts()
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(0.51).crash("alpha")
    h.at(0.6).reserve("beta/b1", 0x11, 8, pid=11)
    h.at(0.8).release("alpha/a1", 0x10, 7, pid=12)
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    assert run.unlogged_reserves == 1
    # the same release after a reserve call that ended (it noted done, and no reserve: it
    # raised) explains nothing
    h = _two_hosts()
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1).done("reserve", "alpha", 0.5, pid=1)
    h.at(0.51).crash("alpha")
    h.at(0.8).release("alpha/a1", 0x10, 7, pid=12)
    assert "released its hold of 0x10 (token 7), but the hold is None" in _why(h)
    # nor the release of a hold older than one noted before the call began
    h = _two_hosts()
    h.at(0.4).reserve("beta/b1", 0x11, 9, pid=11)
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(0.51).crash("alpha")
    h.at(0.8).release("alpha/a1", 0x10, 7, pid=12)
    assert "before its call began" in _why(h)


def test_a_reserve_whose_agent_killed_itself_may_be_released_before_the_kill_is_noted():
    # the commit+kill nemesis: alpha's agent dies at a fault point right after the reserve's
    # commit; its hook fails, and the failed start's release runs in the hook's own process
    # (token 7) before the test, which learns of the death once the start returned, notes it
    h = _two_hosts()
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(0.8).release("alpha/a1", 0x10, 7, pid=12)
    h.at(1.5).crash("alpha")
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    assert run.unlogged_reserves == 1
    # a reserve begun only after that release explains nothing
    h = _two_hosts()
    h.at(0.8).release("alpha/a1", 0x10, 7, pid=12)
    h.at(0.9).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(1.5).crash("alpha")
    assert "released its hold of 0x10 (token 7), but the hold is None" in _why(h)


def test_a_take_back_of_a_hold_nobody_noted_may_follow_newer_holds_noted_meanwhile():
    # the commit+kill nemesis beside busy loops (2026-11-30): alpha's agent dies right after
    # its reserve's commit (token 7); beta notes a reserve of another device (token 8), then
    # alpha's lease ends and the lender takes 0x10 back with 7, before the test notes the kill
    h = _two_hosts()
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(0.6).reserve("beta/b1", 0x11, 8, pid=11)
    h.at(2.8).take_back(0x10, 7)
    h.at(3.0).crash("alpha")
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    # a token a noted reserve has is not that hold's
    h = _two_hosts()
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(0.6).reserve("beta/b1", 0x11, 8, pid=11)
    h.at(2.8).take_back(0x10, 8)
    h.at(3.0).crash("alpha")
    assert "the fence's is None" in _why(h)
    # nor is one the device has retired already
    h = _two_hosts()
    h.at(0.1).reserve("alpha/a1", 0x10, 5, pid=1)
    h.at(0.2).spend("alpha/a1", 0x10, 5).release("alpha/a1", 0x10, 5, pid=1)
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(0.6).reserve("beta/b1", 0x11, 8, pid=11)
    h.at(2.8).take_back(0x10, 4)
    h.at(3.0).crash("alpha")
    assert "the fence's is None" in _why(h)


def test_a_hold_nobody_noted_is_credited_only_to_a_call_that_began_before_newer_tokens():
    # (a review's four sequences, 2026-11-30) beta notes token 8 at 0.6; a call begun at 0.7
    # commits a newer token, so a take-back of 7 on 0x10 cannot end its hold
    h = _two_hosts()
    h.at(0.6).reserve("beta/b1", 0x11, 8, pid=11)
    h.at(0.7).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(2.8).take_back(0x10, 7)
    h.at(3.0).crash("alpha")
    assert "a take-back of 0x10" in _why(h)
    # nor a registry-away reserve begun then, noted after the take-back
    h = _two_hosts()
    h.at(0.6).reserve("beta/b1", 0x11, 8, pid=11)
    h.at(2.8).take_back(0x10, 7)
    h.at(3.0).add("reserve-unknown", "alpha", 12, fdid=0x10, node="alpha", vm="a1", began=0.7)
    assert "a take-back of 0x10" in _why(h)
    # a hold 7 of 0x10 taken back after the device's hold 8 was made: 8 was made over it
    h = _two_hosts()
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(0.6).reserve("beta/b1", 0x10, 8, pid=11)
    h.at(0.7).release("beta/b1", 0x10, 8, pid=11)
    h.at(2.8).take_back(0x10, 7)
    h.at(3.0).crash("alpha")
    assert "a take-back of 0x10" in _why(h)
    # of two cut-short calls of one VM, the release of 7 is the first's (the second began
    # after token 8 was noted)
    h = _two_hosts()
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(0.51).crash("alpha")
    h.at(0.6).up("alpha", 0xA1, pid=4, adopted=True)
    h.at(0.65).reserve("beta/b1", 0x11, 8, pid=11)
    h.at(0.7).begin("reserve", "alpha/a1", 0x10, pid=4)
    h.at(0.8).release("alpha/a1", 0x10, 7, pid=12)
    h.at(1.5).add("crash", "alpha", pid=99, agent=4)
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()


def test_a_reserve_noted_by_nobody_is_checked_as_any_reserve():
    # on a fenced device (beta's hold ended with its lease, nobody took it back)
    h = _two_hosts()
    h.at(0.5).reserve("beta/b1", 0x10, 5, pid=11)
    h.at(2.5).add("lease-lost", "beta", 2, lease=0xB1)
    h.at(2.6).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(2.61).crash("alpha")
    h.at(2.8).release("alpha/a1", 0x10, 7, pid=12)
    assert "0x10 is fenced" in _why(h)
    # while another hold lived: token 7 > 6 committed after b1's (noted at 0.52), and b1's
    # release began at 0.6 (both held 0x10 between)
    h = _two_hosts()
    h.at(0.5).begin("reserve", "alpha/a1", 0x10, pid=1)
    h.at(0.51).crash("alpha")
    h.at(0.52).reserve("beta/b1", 0x10, 6, pid=11)
    h.at(0.7).add("release", "beta", 11, fdid=0x10, node="beta", vm="b1", token=6, began=0.6)
    h.at(0.8).release("alpha/a1", 0x10, 7, pid=12)
    assert "cannot have ended before" in _why(h)


def _stopped_before_its_follow_note(done: float | None) -> History:
    """beta's new agent moves its records and publishes its lease file at 0.01, then is
    stopped past the TTL (the freeze-start nemesis) and notes the follow at 3.0, after its
    lender took back the device it re-reserved under that lease."""
    h = History().up("alpha", 0xA1)
    h.at(0.0).add("restart", "beta", pid=99)
    h.at(0.001).add("lease-granted", "beta", 2, lease=0xB1, ttl=TTL, sent=0.001)
    h.at(0.02).reserve("beta/b1", 0x10, 6, pid=2)
    h.at(2.5).take_back(0x10, 6)
    at = {"done": done} if done is not None else {}
    return h.at(3.0).add("lease-followed", "beta", 2, lease=0xB1, **at)


def test_a_follow_noted_after_its_lease_ended_is_placed_when_etcd_took_it():
    run = replay(_stopped_before_its_follow_note(0.01).events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    # without the time of the move (an agent before it was noted), as refused as before
    assert "lease 2 of beta is gone" in _why(_stopped_before_its_follow_note(None))
    # and a move done after the lease ended is refused
    assert "lease 2 of beta is gone" in _why(_stopped_before_its_follow_note(2.9))


def test_a_take_back_before_the_lease_could_end_is_refused():
    h = _two_hosts()
    h.at(0.5).reserve("beta/b1", 0x10, 6, pid=11)
    h.at(1.5).renew("beta", 0xB1).crash("beta")
    h.at(3.0).take_back(0x10, 6)  # beta's lease lives until 3.5 at least
    assert "lease 2 of beta cannot have ended before 3.500" in _why(h)


def test_a_take_back_with_another_token_than_the_fences_is_refused():
    h = _two_hosts()
    h.at(0.5).reserve("beta/b1", 0x10, 6, pid=11).crash("beta")
    h.at(3.0).take_back(0x10, 4)
    assert "the fence's is 6" in _why(h)


def test_a_resume_with_the_lease_in_doubt_is_refused():
    h = _two_hosts()
    h.at(1.5).add("resume", "alpha", 1, vm="a1", decided=1.5)  # granted at 0: TTL/2 passed
    assert "in doubt" in _why(h)


def test_a_release_logged_after_the_next_reserve_is_put_back_in_etcds_order():
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5)
    h.at(0.8).reserve("beta/b1", 0x10, 6, pid=11)
    h.at(0.9).release("alpha/a1", 0x10, 5)  # committed before 6, logged after it
    assert [e.kind for e in ordered(h.events)][-2:] == ["release", "reserve"]
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()


def test_the_event_log_writes_lines_the_replay_reads(tmp_path: Path):
    log = EventLog(tmp_path, "alpha")
    log.note("restart")
    log.note("lease-granted", lease=0xA1, ttl=TTL, sent=1.0)
    events = read_events(tmp_path / "events.jsonl")
    assert [(e.kind, e.actor, e.seq) for e in events] == [
        ("restart", "alpha", 0), ("lease-granted", "alpha", 1)]
    assert events[1].fields == {"lease": 0xA1, "ttl": TTL, "sent": 1.0}


def test_commits_whose_reply_was_lost_are_taken_as_made():
    h = _two_hosts()
    # a reserve whose Txn committed on one member and, re-sent to the next, found its hold
    h.at(0.5).add("reserve", "alpha", 10, fdid=0x10, node="alpha", vm="a1", token=5,
                  created=False)
    h.at(0.6).add("reserve", "alpha", 10, fdid=0x10, node="alpha", vm="a1", token=5,
                  created=False)  # the VM had it: nothing new
    h.at(0.7).spend("alpha/a1", 0x10, 5)
    h.at(0.8).add("release", "alpha", 10, fdid=0x10, node="alpha", vm="a1", token=5,
                  lost_reply=True)
    h.at(0.9).reserve("beta/b1", 0x10, 6, pid=11)
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
    assert run.lost_replies == 2 and run.ended == 0


def test_a_second_reserve_of_a_hold_does_not_move_its_release_before_its_serve():
    """Seed 4: a call found the hold its VM had (created False, same token) after the hold's
    serve; the release, logged later, must stay after the serve."""
    h = _two_hosts()
    h.at(0.5).reserve("alpha/a1", 0x10, 5).at(0.6).serve("alpha/a1", 0x10, 5)
    h.at(0.7).add("reserve", "alpha", 12, fdid=0x10, node="alpha", vm="a1", token=5,
                  created=False)
    h.at(0.8).renew("alpha", 0xA1).spend("alpha/a1", 0x10, 5)
    h.at(0.9).release("alpha/a1", 0x10, 5)
    assert [e.kind for e in ordered(h.events) if e.fdid == 0x10] == [
        "reserve", "serve", "reserve", "end", "release"]
    run = replay(h.events, ttl=TTL)
    assert run.refusal is None, run.refusal.describe()
