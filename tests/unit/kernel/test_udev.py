"""Uevent handling: a parent coming back re-creates running VMs' mdevs; leaving marks them
unavailable. Events travel through a real pipe into the watcher's select loop."""

from __future__ import annotations

import os

import pytest

from tests.support.fake_sysfs import FakeSysfs, FakeType, PipeUeventSource
from vmlend.errors import FabricError, HostError, RegistryUnreachableError
from vmlend.hostenv import HostEnv
from vmlend.kernel.dmafiles import DmaWord
from vmlend.kernel.mdev import MdevBus
from vmlend.kernel.udev import (
    Outcome,
    ParentChange,
    ParentWatcher,
    PyudevSource,
    Reaction,
    Uevent,
    WantedMdev,
    classify,
    dma_change,
)

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002"
P = "fdid-00000010"
TYPES = [FakeType("smartio-lend", available=2)]


@pytest.fixture
def fake(tmp_path) -> FakeSysfs:
    f = FakeSysfs(tmp_path)
    f.add_parent(P, TYPES)
    return f


@pytest.fixture
def source():
    s = PipeUeventSource()
    yield s
    s.close()


def make_watcher(fake, wanted, **kw) -> ParentWatcher:
    """A watcher that has reconciled once; its reactions then hold only what events cause."""
    w = ParentWatcher(MdevBus(fake.env, fake), lambda: list(wanted), **kw)
    w.discover()
    w.reactions.clear()
    return w


@pytest.mark.parametrize(
    ("ev", "now", "was", "want"),
    [
        (Uevent("change", P, "pci", {"MDEV_STATE": "registered"}), True, False, "appeared"),
        (Uevent("change", P, "pci", {"MDEV_STATE": "unregistered"}), False, True, "vanished"),
        (Uevent("remove", P, "smartio"), False, True, "vanished"),
        (Uevent("add", P, "smartio"), True, False, "appeared"),
        (Uevent("add", P, "smartio"), False, False, None),  # device back, not yet a parent
        (Uevent("change", P, "pci"), True, True, None),  # nothing new
        (Uevent("remove", "other", "pci"), False, False, None),
    ],
)
def test_classify(ev, now, was, want):
    got = classify(ev, now, was)
    assert (got.value if got else None) == want


def test_parent_returning_recreates_running_vms_mdevs(fake, source):
    bus = MdevBus(fake.env, fake)
    bus.create(P, "smartio-lend", U1)
    wanted = [WantedMdev(U1, P, "smartio-lend", vm="web"), WantedMdev(U2, "other", "x", vm="db")]
    gone, back = [], []
    w = make_watcher(fake, wanted, on_vanished=gone.append, on_appeared=back.append)
    back.clear()  # discover() reported the parent present at start
    fake.listeners.append(source.send)

    fake.remove_parent(P)  # lender reboots: the kernel drops the parent and its children
    fake.add_parent(P, TYPES)  # ... and it comes back
    assert bus.device(U1) is None
    stop_r, stop_w = os.pipe()
    os.write(stop_w, b"x")
    handled = w.run(source, stop_fd=stop_r, timeout=5)
    os.close(stop_r)
    os.close(stop_w)

    # child remove, unregistered, registered, then the add of the child the watcher re-created
    assert handled == 4
    assert gone == [P] and back == [P]
    assert [(r.outcome, r.uuid, r.vm) for r in w.reactions] == [
        (Outcome.UNAVAILABLE, U1, "web"),
        (Outcome.RECREATED, U1, "web"),
    ]
    dev = bus.device(U1)
    assert dev is not None and dev.parent == P
    assert w.unavailable == set()


def test_parent_vanishing_marks_unavailable(fake, source):
    w = make_watcher(fake, [WantedMdev(U1, P, "smartio-lend", vm="web")])
    fake.listeners.append(source.send)
    fake.remove_parent(P)  # discover() had created U1: its removal is an event too
    assert w.run(source, timeout=0.2) == 2
    assert w.unavailable == {P}
    assert [r.outcome for r in w.reactions] == [Outcome.UNAVAILABLE]


def test_remove_without_mdev_state_still_counts(fake):
    w = make_watcher(fake, [])
    fake.remove_parent(P, announce=False)
    assert w.handle(Uevent("remove", P, "smartio")) == []
    assert w.unavailable == {P}


def test_existing_child_is_reported_present_not_recreated(fake):
    bus = MdevBus(fake.env, fake)
    bus.create(P, "smartio-lend", U1)
    w = ParentWatcher(bus, lambda: [WantedMdev(U1.upper(), P, "smartio-lend")])
    (r,) = w.handle(Uevent("change", P, "pci", {"MDEV_STATE": "registered"}))
    assert r.outcome is Outcome.PRESENT and r.uuid == U1


def test_failed_recreate_is_reported_and_others_continue(fake):
    fake.add_parent("p2", [FakeType("t", available=1)])
    wanted = [
        WantedMdev(U1, "p2", "no-such-type", vm="a"),
        WantedMdev(U2, "p2", "t", vm="b"),
    ]
    w = ParentWatcher(MdevBus(fake.env, fake), lambda: wanted)
    out = w.handle(Uevent("change", "p2", "pci", {"MDEV_STATE": "registered"}))
    assert [r.outcome for r in out] == [Outcome.FAILED, Outcome.RECREATED]
    assert "no-such-type" in out[0].detail


def test_discover_notices_parents_gone_while_not_watching(fake):
    gone = []
    w = make_watcher(fake, [], on_vanished=gone.append)
    fake.remove_parent(P, announce=False)
    assert w.discover() == []
    assert gone == [P]


def test_child_events_are_ignored(fake):
    w = make_watcher(fake, [])
    assert w.handle(Uevent("remove", U1, "mdev")) == []
    assert w.unavailable == set()


def test_run_times_out_with_nothing_to_do(fake, source):
    assert make_watcher(fake, []).run(source, timeout=0.05) == 0


def test_live_source_refuses_a_fake_root(tmp_path):
    with pytest.raises(HostError):
        PyudevSource.for_host(HostEnv(tmp_path))


def test_live_source_listens_to_the_kernel_where_no_udevd_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(HostEnv, "run", property(lambda self: tmp_path))
    assert PyudevSource.netlink_source(HostEnv()) == "kernel"
    (tmp_path / "udev").mkdir()
    (tmp_path / "udev" / "control").touch()  # udevd's control socket
    assert PyudevSource.netlink_source(HostEnv()) == "udev"


def test_pyudev_adapter_converts_devices():
    class FakeDevice:
        action = "change"
        sys_name = P
        subsystem = "pci"
        properties = {"MDEV_STATE": "registered"}

    class FakeMonitor:
        def __init__(self):
            self.queue = [FakeDevice()]
            self.started = False

        def start(self):
            self.started = True

        def fileno(self):
            return 0

        def poll(self, timeout=None):
            assert timeout == 0  # the adapter must never block
            return self.queue.pop() if self.queue else None

    mon = FakeMonitor()
    src = PyudevSource(mon)
    assert mon.started
    assert src.receive() == Uevent("change", P, "pci", {"MDEV_STATE": "registered"})
    assert src.receive() is None
    assert classify(Uevent("change", P, "", {"MDEV_STATE": "registered"}), False, False) is (
        ParentChange.APPEARED
    )


def test_one_vanishing_reported_twice_reacts_once(fake):
    gone = []
    w = make_watcher(fake, [WantedMdev(U1, P, "smartio-lend")], on_vanished=gone.append)
    fake.remove_parent(P)  # emits MDEV_STATE=unregistered
    assert len(w.handle(Uevent("remove", P, "smartio"))) == 1
    assert w.handle(Uevent("change", P, "pci", {"MDEV_STATE": "unregistered"})) == []
    assert gone == [P]


def test_explicit_registered_rechecks_a_known_parent(fake):
    # The parent left and came back while nobody listened: only MDEV_STATE tells us.
    w = make_watcher(fake, [WantedMdev(U1, P, "smartio-lend")])
    fake.remove_parent(P, announce=False)
    fake.add_parent(P, TYPES, announce=False)
    assert MdevBus(fake.env, fake).device(U1) is None
    assert w.handle(Uevent("add", P, "pci")) == []
    (r,) = w.handle(Uevent("change", P, "pci", {"MDEV_STATE": "registered"}))
    assert r.outcome is Outcome.RECREATED


def test_discover_at_start_creates_missing_wanted_children(fake):
    bus = MdevBus(fake.env, fake)
    bus.create(P, "smartio-lend", U1)
    wanted = [WantedMdev(U1, P, "smartio-lend", "web"), WantedMdev(U2, P, "smartio-lend", "db")]
    w = ParentWatcher(bus, lambda: wanted)
    assert w.discover() == [P]
    assert [(r.uuid, r.outcome) for r in w.reactions] == [
        (U1, Outcome.PRESENT),
        (U2, Outcome.RECREATED),
    ]
    assert bus.device(U2) is not None
    assert w.discover() == [P]  # nothing new: nothing done
    assert len(w.reactions) == 2


@pytest.mark.parametrize(
    ("ev", "want"),
    [
        (Uevent("change", U1.upper(), "mdev", {"SMARTIO_DMA": "mapped"}), (U1, DmaWord.MAPPED)),
        (Uevent("change", U1, "mdev", {"SMARTIO_DMA": "none", "SMARTIO_BARS": "0"}),
         (U1, DmaWord.NONE)),
        (Uevent("change", U1, "mdev", {"SMARTIO_DMA": "refused"}), (U1, DmaWord.REFUSED)),
        (Uevent("change", U1, "mdev", {"SMARTIO_BARS": "2"}), None),  # not a DMA change
        (Uevent("change", U1, "mdev", {}), None),
        (Uevent("add", U1, "mdev", {"SMARTIO_DMA": "mapped"}), None),
        (Uevent("change", P, "smartio", {"SMARTIO_DMA": "mapped"}), None),  # not a child
    ],
)  # fmt: skip
def test_dma_change(ev, want):
    got = dma_change(ev)
    assert (None if got is None else (got.uuid, got.word)) == want


@pytest.mark.parametrize(
    ("props", "name", "said"),
    [
        ({"SMARTIO_DMA": "mapping"}, U1, "'mapping'"),
        ({"SMARTIO_DMA": ""}, U1, "none of none, mapped, partial, refused"),
        ({"SMARTIO_DMA": "refused ENODATA"}, U1, "'refused ENODATA'"),
        ({"SMARTIO_DMA": "mapped"}, "../../../etc", "no mdev's UUID"),
    ],
)
def test_a_dma_change_against_the_contract_is_refused(props, name, said):
    with pytest.raises(ValueError, match=said):
        dma_change(Uevent("change", name, "mdev", props))


def test_dma_changes_reach_the_callback_through_the_pipe(fake, source):
    seen = []

    def on_dma(change):
        seen.append((change.uuid, change.word))
        return Reaction(P, Outcome.DMA_RECORDED, change.uuid, "web", change.word.value)

    w = make_watcher(fake, [], on_dma=on_dma)
    source.send(Uevent("change", U1, "mdev", {"SMARTIO_FDID": "0x10", "SMARTIO_DMA": "mapped"}))
    source.send(Uevent("change", U2, "mdev", {"SMARTIO_DMA": "garbage"}))
    source.send(Uevent("change", U1, "mdev", {"SMARTIO_DMA": "none"}))
    assert w.run(source, timeout=0.05) == 3
    assert seen == [(U1, DmaWord.MAPPED), (U1, DmaWord.NONE)]
    assert [(r.outcome, r.detail) for r in w.reactions] == [
        (Outcome.DMA_RECORDED, "mapped"),
        (Outcome.DMA_RECORDED, "none"),
    ]


def test_a_refused_step_after_recreating_removes_the_child(fake):
    def refuse(w):
        if w.vm == "web":
            raise FabricError("the SmartIO driver refused the DMA windows (ERANGE)")

    wanted = [WantedMdev(U1, P, "smartio-lend", vm="web"), WantedMdev(U2, P, "smartio-lend", "db")]
    w = ParentWatcher(MdevBus(fake.env, fake), lambda: wanted, on_recreated=refuse)
    w.discover()
    assert [(r.outcome, r.uuid, r.detail) for r in w.reactions] == [
        (Outcome.FAILED, U1, "the SmartIO driver refused the DMA windows (ERANGE)"),
        (Outcome.RECREATED, U2, ""),
    ]
    bus = MdevBus(fake.env, fake)
    assert bus.device(U1) is None and bus.device(U2) is not None


def test_a_failing_record_is_a_warning_and_the_watch_goes_on(fake, source, caplog):
    def on_dma(change):
        raise RegistryUnreachableError("127.0.0.1:1", "etcd at 127.0.0.1:1 did not answer")

    w = make_watcher(fake, [], on_dma=on_dma)
    source.send(Uevent("change", U1, "mdev", {"SMARTIO_DMA": "mapped"}))
    source.send(Uevent("change", U2, "mdev", {"SMARTIO_DMA": "mapped"}))
    assert w.run(source, timeout=0.05) == 2
    assert w.reactions == []
    assert caplog.text.count("could not record the DMA state of mdev") == 2
