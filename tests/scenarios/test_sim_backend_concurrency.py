"""Two real processes race to reserve the same devices: exactly one wins each device."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from tests.support.simfabric import make_fabric
from vmlend.errors import DeviceHeldError
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import open_fabric

ROUNDS = 25
# Every device but the GPU 0x20: together their BARs fill 31 of gamma:0's 32 segments, so
# admission never refuses and any loss must come from the other racer.
FDIDS = [0x10, 0x11, 0x12, 0x21, 0x22, 0x23, 0x24, 0x25]


def _racer(path, name, order, barrier, results):
    try:
        _race(path, name, order, barrier, results)
    except BaseException as e:  # report instead of leaving the parent waiting
        results.put(("error", name, repr(e), []))
        barrier.abort()
        raise


def _race(path, name, order, barrier, results):
    """Each round: wait for the other racer, try every device, report, then release."""
    fabric = open_fabric(path)
    me = Holder("gamma", name)
    for rnd in range(ROUNDS):
        barrier.wait()
        won, lost = [], []
        for fdid in order:
            try:
                fabric.reserve(fdid, me, guest_ram=8 * GiB)
                won.append(fdid)
            except DeviceHeldError as e:
                lost.append((fdid, e.node, e.vm))
        results.put((rnd, name, won, lost))
        barrier.wait()  # both done before anyone releases
        for fdid in won:
            assert fabric.release(fdid, me)
        barrier.wait()
    fabric.close()


@pytest.mark.parametrize(
    ("racers", "fdids"),
    [(2, FDIDS), (4, [0x10])],
    ids=["two-racers-all-devices", "four-racers-one-device"],
)
def test_exactly_one_process_wins_each_device(tmp_path, racers, fdids):
    path = tmp_path / "state.db"
    make_fabric(path).close()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(racers, timeout=30)
    results = ctx.Queue()
    names = [f"vm{i}" for i in range(racers)]
    procs = [
        # Alternate directions so racers meet in the middle of the list.
        ctx.Process(target=_racer, args=(path, n, fdids[:: 1 - 2 * (i % 2)], barrier, results))
        for i, n in enumerate(names)
    ]
    for p in procs:
        p.start()
    got = []
    for _ in range(racers * ROUNDS):
        got.append(results.get(timeout=30))
        assert got[-1][0] != "error", f"racer {got[-1][1]} failed: {got[-1][2]}"
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rnd in range(ROUNDS):
        this = [r for r in got if r[0] == rnd]
        winner = {}
        for _, name, won, _lost in this:
            for fdid in won:
                assert fdid not in winner, (
                    f"round {rnd}: {fdid:#x} won by {winner[fdid]} and {name}"
                )
                winner[fdid] = name
        assert sorted(winner) == sorted(fdids), f"round {rnd}: a device nobody won"
        for _, name, _won, lost in this:
            for fdid, node, vm in lost:  # every loss names the winner
                assert (node, vm) == ("gamma", winner[fdid]) and vm != name
    with open_fabric(path) as f:
        assert all(st.holder is None for st in f.devices())
        assert all(u.lut_used == 0 and u.segments_used == 0 for u in f.usage().values())
