"""A composite step is atomic too (issue 10, part 5): when two real processes acquire the same
VM's device at once, the one that rolls back undoes only what it created itself.

The interleaving is forced, not left to timing: process A is stopped right before its
reservation (a fabric wrapper waits on an event there) while process B acquires the device
completely; then A goes on, and rolls back as a failed start would."""

from __future__ import annotations

import multiprocessing as mp
import uuid

from tests.support.simfabric import make_fabric
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import open_fabric

VM = Holder("gamma", "vm1", "11111111-1111-1111-1111-111111111111")
MDEV = str(uuid.UUID(int=0x10))
FDID = 0x10
WAIT = 30  # seconds: every wait is bounded


class _PausedBeforeReserve:
    """The fabric, except that ``reserve`` first lets the other process run to its end."""

    def __init__(self, fabric, paused, resume) -> None:
        self._fabric = fabric
        self._paused = paused
        self._resume = resume

    def __getattr__(self, name):
        return getattr(self._fabric, name)

    def reserve(self, *args, **kwargs):
        self._paused.set()
        if not self._resume.wait(WAIT):
            raise TimeoutError("the other process did not finish")
        return self._fabric.reserve(*args, **kwargs)


def _first(path, paused, resume, results) -> None:
    """Acquire through the paused fabric, then roll back (as a later failure would)."""
    try:
        with open_fabric(path) as fabric:
            journal = UndoJournal()
            acquire_device(
                _PausedBeforeReserve(fabric, paused, resume), VM, FDID, MDEV, journal,
                guest_ram=8 * GiB,
            )  # fmt: skip
            undone = [what for what, _undo in journal.steps]
            journal.rollback()
        results.put(("ok", undone))
    except BaseException as e:  # report instead of leaving the parent waiting
        results.put(("error", repr(e)))
        paused.set()


def _second(path, paused, resume, results) -> None:
    """Wait until the first process is about to reserve, then acquire the device fully."""
    try:
        if not paused.wait(WAIT):
            raise TimeoutError("the first process never reached its reservation")
        with open_fabric(path) as fabric:
            acquire_device(fabric, VM, FDID, MDEV, UndoJournal(), guest_ram=8 * GiB)
        results.put(("ok", []))
    except BaseException as e:
        results.put(("error", repr(e)))
    finally:
        resume.set()


def test_a_rollback_leaves_what_another_process_created(tmp_path):
    path = tmp_path / "state.db"
    make_fabric(path).close()
    ctx = mp.get_context("fork")
    paused, resume, results = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(path, paused, resume, results))
        for target in (_first, _second)
    ]
    for p in procs:
        p.start()
    try:
        outcomes = [results.get(timeout=WAIT * 2) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=WAIT)
            if p.is_alive():
                p.kill()  # by this process's own handle, never by name
    assert all(o[0] == "ok" for o in outcomes), outcomes
    assert sorted(o[1] for o in outcomes) == [[], []]  # the first one created nothing
    with open_fabric(path) as fabric:
        assert fabric.device(FDID).holder == VM  # the second process's hold stands
        assert [m.uuid for m in fabric.mdevs()] == [MDEV]  # and its mdev
