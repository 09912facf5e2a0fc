"""Issue 20's proof, bounded for CI: a 3-member etcd, three hosts with their own agents (TTL 2 s)
and simulated hypervisors, and a workload of VM starts, stops, hot-adds and hot-removes over
devices that VMs on two hosts want. Then the nemeses (``tests/support/nemesis.py``,
``NEMESES``), one per round: kill -9 of an agent restarted at once, and one restarted only after
its lease ended; SIGSTOP of an agent past the TTL, in its loop and (restarted after its lease
ended) in its start-up; SIGSTOP of a hook mid-prepare and of one mid-release past the TTL; a
silent partition of one host from etcd past the TTL; loss of quorum past the TTL; kill -9 of the
etcd leader; a domain the hypervisor does not answer for while its agent resumes it; bytes of
a host's copy of the topology flipped and its agent restarted, so a fresh process of the host
meets the damage (it must read the registry instead, remove the copy, and a good copy follow);
and combined: a hook frozen mid-prepare or mid-release, or a ``vmlend attach --live`` frozen just
after its hot-plug, while its host's agent is dead past its lease; an agent killed while its
guard has a VM paused (another paused by an operator), restarted past its lease; a partition
together with a kill of the leader, a frozen agent together with a loss of quorum. A sampler
reads every host's running, unpaused VMs every 0.1 s, and what every device serves (the
simulated lenders' register): each device serves only the borrow of its newest fencing token
(promise (a), at every sample, through every window in which a guard was out of its budget),
and no device may be in two running, unpaused VMs unless only fencing could help and did
(promise (b); ``tests/support/nemesis.py`` says exactly what counts, hot-added devices
included, and when an overlap is excused). After the faults heal: nothing held by a VM that
does not run or does not use it, no running VM using a device it does not hold, nothing
fenced, no revision of the registry with two holders, every failed CLI call said one line, and
the events every process recorded (``vmlend.events``) replay through the protocol's model
(``tests/support/replay.py``) with no step it refuses.

The fixed seed runs every nemesis once, in a shuffled order. ``VMLEND_NEMESIS_SEED`` picks
another seed (the order of faults, their targets and the workload); ``VMLEND_NEMESIS_ROUNDS``
more rounds (the list of all of them repeated); ``VMLEND_NEMESIS_ONLY=hook,leader`` only those.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import pytest

from tests.support.cluster_hosts import check_never_two_holders, history
from tests.support.nemesis import (
    INTERVAL,
    NEMESES,
    TTL,
    WAIT,
    Cluster,
    Sampler,
    Workload,
    define_vms,
    in_use,
    keep_logs,
    live_devices,
    log_evidence,
    seed_from_env,
    start_cluster,
    stop_cluster,
)
from tests.support.replay import replay_file
from vmlend.events import EVENTS_FILE
from vmlend.topology.model import DeviceStatus
from vmlend.wiring.fabric import open_fabric

SEED = seed_from_env(20)
#: Names of ``NEMESES`` to run alone (comma-separated), to explore one of them.
ONLY = [k for k in (os.environ.get("VMLEND_NEMESIS_ONLY") or "").split(",") if k]
assert set(ONLY) <= set(NEMESES), f"VMLEND_NEMESIS_ONLY: not in {sorted(NEMESES)}"
#: One round per nemesis: the fixed seed runs every one of them once.
ROUNDS = int(os.environ.get("VMLEND_NEMESIS_ROUNDS") or len(ONLY or NEMESES))
#: Between two faults: time for the workload to run on a healthy cluster.
CALM = 2.0
#: ``VMLEND_NEMESIS_KEEP=1``: keep the logs (``keep_logs``) of a run that passes too.
KEEP = bool(os.environ.get("VMLEND_NEMESIS_KEEP"))


def _say(line: str) -> None:
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    sys.stderr.write(f"{stamp} nemesis: {line}\n")  # one write: combined nemeses say at once
    sys.stderr.flush()


def _leftovers(c: Cluster) -> list[str]:
    """Holds of VMs that do not run or do not use the device (a hot-remove that did not
    return it), fences, and devices a running VM uses without holding them (a hot-plug that
    outlived its hold): what must be gone once the faults healed."""
    out = []
    with open_fabric(c.direct_url, "alpha") as alpha, open_fabric(c.direct_url, "beta") as beta:
        statuses: list[DeviceStatus] = alpha.devices()
        for st in statuses:
            if st.holder is None:
                continue
            used = live_devices(c.host(st.holder.node), st.holder.vm)
            who = f"{st.holder.node}/{st.holder.vm}"
            if used is None:
                out.append(f"{st.fdid:#x} held by {who}, not running")
            elif st.fdid not in used:
                out.append(f"{st.fdid:#x} held by {who}, which runs without it")
        for f in alpha.fenced() + beta.fenced():
            out.append(f"{f.fdid:#x} fenced (left by {f.holder.node}/{f.holder.vm})")
        holders = {st.fdid: st.holder for st in statuses}
    for h in c.hosts.values():
        for (node, vm, _id), fdids in in_use(h).items():
            for fdid in sorted(fdids):
                held = holders.get(fdid)
                if held is None or (held.node, held.vm) != (node, vm):
                    out.append(f"{node}/{vm} runs with {fdid:#x}, held by {held or 'nobody'}")
    return out


@pytest.mark.slow
@pytest.mark.daemon
def test_no_device_is_ever_in_two_running_vms_under_faults(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    _say(f"seed {SEED}, {ROUNDS} rounds")
    started = time.monotonic()
    c = start_cluster(tmp_path, f"nemesis-{SEED}")
    sampler = Sampler(c)
    work = c.work = Workload(c, SEED)
    try:
        for h in c.hosts.values():
            h.start_agent()
        define_vms(c)
        sampler.start()
        work.start()
        # every one, in a seeded order (more rounds repeat them); VMLEND_NEMESIS_ONLY: a few
        kinds = sorted(ONLY or NEMESES)
        order = [kinds[i % len(kinds)] for i in range(ROUNDS)]
        rng.shuffle(order)
        _say(f"order: {', '.join(order)}")
        for n, kind in enumerate(order, 1):
            time.sleep(CALM)
            NEMESES[kind](c, rng, lambda line, n=n: _say(f"round {n}: {line}"))
        time.sleep(CALM)
        work.stop()
        # Healed: after a TTL and a scan interval every lease that had to end has ended and
        # every lender has taken back what it had to; the VMs still running keep their holds.
        time.sleep(TTL + INTERVAL)
        deadline = time.monotonic() + WAIT
        while (left := _leftovers(c)) and time.monotonic() < deadline:
            time.sleep(0.5)
        sampler.stop()
        sampler.sample()  # and once more at the end
        sampler.lender.finish()
        work.stop_all_vms()
        deadline = time.monotonic() + WAIT
        while (after_stop := _leftovers(c)) and time.monotonic() < deadline:
            time.sleep(0.5)
        ran = time.monotonic() - started

        def ok(kind: str) -> str:
            of = [x for x in work.calls if x.argv[0] == kind or x.argv[1] == kind]
            return f"{sum(x.returncode == 0 for x in of)} of {len(of)} {kind}s"

        _say(
            f"{len(order)} faults, {sampler.samples} samples, {len(work.calls)} CLI calls"
            f" ({ok('start')}, {ok('attach')}, {ok('detach')} succeeded), {ran:.0f} s"
        )
        _say_promise_a(c, sampler)
        cc = sampler.claims
        _say(
            f"DMA claims against each VM's RAM layout: {len(cc.drift)} difference(s) in"
            f" {cc.reads} reads ({cc.unread} failed)"
        )
        for line in cc.drift:
            _say(f"  {line}")
        # every recorded history must be one the protocol's model allows (issue 35, point 10)
        replayed = replay_file(tmp_path / "events" / EVENTS_FILE)
        _say(f"replayed through the model: {replayed.summary()}")
        if replayed.refusal is not None:
            _say(replayed.refusal.describe())
        log_evidence(c, sampler.overlaps)
        for o in sampler.overlaps:
            _say(o.describe())
            if not o.excused:  # what the workload did to those VMs around it
                vms = {(n, v) for n, v, _i in o.runs}
                for x in work.calls:
                    vm = x.argv[1] if x.argv[0] in ("attach", "detach") else x.argv[-1]
                    if (x.node, vm) in vms and abs(x.wall - o.wall) < 10:
                        _say(f"  {x.describe()}")
        for x in work.calls:
            if x.returncode != 0:
                _say(f"{x.node}: {' '.join(x.argv)}: {x.stderr.strip()}")
        assert not sampler.lender.violations, "\n".join(sampler.lender.violations)
        assert not [o for o in sampler.overlaps if not o.excused], "\n".join(
            o.describe() for o in sampler.overlaps
        )
        assert not sampler.errors, sampler.errors
        assert not left, left
        assert not sampler.claims.drift, sampler.claims.drift
        assert not after_stop, after_stop
        bad = [x for x in work.calls if x.returncode != 0 and len(x.stderr.splitlines()) != 1]
        assert not bad, "\n".join(f"{x.node}: {' '.join(x.argv)}: {x.stderr!r}" for x in bad)
        check_never_two_holders(history(c.direct_url))
        assert replayed.refusal is None, replayed.refusal.describe()
        if KEEP:
            _say(f"logs kept in {keep_logs(c, f'seed-{SEED}')}")
    except BaseException as e:
        # The agents' logs are the only record of what they did: kept out of pytest's
        # temporary directory, which later runs remove.
        kept = keep_logs(c, f"seed-{SEED}")
        _say(f"FAILED: every host's agent.log and the etcd members' logs are in {kept}")
        e.add_note(f"nemesis seed {SEED}: every host's agent.log and the etcd logs: {kept}")
        raise
    finally:
        sampler.stop()
        sampler.close()
        work.stop(check=False)
        stop_cluster(c)


def _say_promise_a(c: Cluster, sampler: Sampler) -> None:
    """Promise (a) at every sample, and through each window in which a host's guard was out
    of its budget (its agent frozen, dead, or just back): the samples taken in each."""
    a = sampler.lender
    held = "held" if not a.violations else f"FAILED {len(a.violations)} time(s)"
    _say(
        f"promise (a), each device serves only the borrow of its newest token: {held} at"
        f" {sampler.samples} samples ({a.checked} reads of the register; {a.unread} etcd"
        f" reads failed, the bound before them stood), {sampler.unguarded_samples} of them"
        " with a guard out of its budget"
    )
    to_wall = time.time() - time.monotonic()
    for h in c.hosts.values():
        for i, (t0, t1) in enumerate(h.unguarded):
            if t0 is None:
                continue
            w0, w1 = t0 + to_wall, (t1 + to_wall) if t1 is not None else time.time()
            span = f"{time.strftime('%H:%M:%S', time.gmtime(w0))}-"
            span += time.strftime("%H:%M:%S", time.gmtime(w1))
            bad = sum(w0 <= t <= w1 for t in a.violated_at)
            verdict = "held" if not bad else f"FAILED {bad} time(s)"
            n = sampler.in_window[(h.node, i)]
            _say(f"  {h.node}'s guard out of its budget {span}: (a) {verdict} at {n} samples")
