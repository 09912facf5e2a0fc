"""Two real processes race to reserve the same devices: exactly one wins each device."""

from __future__ import annotations

import multiprocessing as mp

from vmlend.errors import DeviceHeldError
from vmlend.fabric.model import GiB, Holder
from vmlend.fabric.open import open_fabric

from .simfabric import make_fabric

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


def test_exactly_one_of_two_processes_wins_each_device(tmp_path):
    path = tmp_path / "state.db"
    make_fabric(path).close()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2, timeout=30)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_racer, args=(path, "vmA", FDIDS, barrier, results)),
        ctx.Process(target=_racer, args=(path, "vmB", FDIDS[::-1], barrier, results)),
    ]
    for p in procs:
        p.start()
    got = []
    for _ in range(2 * ROUNDS):
        got.append(results.get(timeout=30))
        assert got[-1][0] != "error", f"racer {got[-1][1]} failed: {got[-1][2]}"
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    contested = 0
    for rnd in range(ROUNDS):
        a = next(r for r in got if r[0] == rnd and r[1] == "vmA")
        b = next(r for r in got if r[0] == rnd and r[1] == "vmB")
        assert not set(a[2]) & set(b[2]), f"round {rnd}: both won {set(a[2]) & set(b[2])}"
        assert sorted(a[2] + b[2]) == sorted(FDIDS), f"round {rnd}: a device nobody won"
        # Every loss names the winner.
        assert all((node, vm) == ("gamma", "vmB") for _, node, vm in a[3])
        assert all((node, vm) == ("gamma", "vmA") for _, node, vm in b[3])
        contested += bool(a[2] and b[2])
    assert contested, "the racers never overlapped: the test proved nothing"
    with open_fabric(path) as f:
        assert all(st.holder is None for st in f.devices())
        assert all(u.lut_used == 0 and u.segments_used == 0 for u in f.usage().values())
