"""The marks the agent keeps of the VMs it paused itself (``vmlend.agent.pause_marks``), and
the guard that writes and clears them."""

from __future__ import annotations

import logging
import os
import threading

from tests.support.simcluster import domain_of
from tests.support.simfabric import make_fabric
from vmlend.agent.guard import RemoteVmGuard
from vmlend.agent.pause_marks import PauseMarks
from vmlend.errors import LibvirtError
from vmlend.hypervisor.base import DomainState
from vmlend.sim.hypervisor.node import SimHypervisor

GPU = 0x10  # lent by alpha: remote for gamma
APP = "33333333-3333-3333-3333-333333333333"


def test_a_mark_is_kept_until_cleared_whatever_the_vm_is_called(tmp_path):
    marks = PauseMarks(tmp_path / "paused")
    assert marks.names() == []  # no directory yet
    odd = "../web vm/ü\n"
    marks.mark("web")
    marks.mark(odd)
    marks.mark("web")  # twice: one mark
    assert marks.names() == sorted(["web", odd])
    assert sorted(os.listdir(tmp_path)) == ["paused"]  # nothing written outside
    marks.clear(odd)
    marks.clear("never-marked")
    assert PauseMarks(tmp_path / "paused").names() == ["web"]  # on disk, for the next agent


def test_files_that_are_not_marks_are_ignored(tmp_path):
    marks = PauseMarks(tmp_path)
    marks.mark("web")
    (tmp_path / "db").write_text("db")  # not named after its content's digest
    (tmp_path / "notes").mkdir()
    os.symlink("/etc/passwd", tmp_path / "link")
    assert marks.names() == ["web"]


def test_a_mark_that_cannot_be_written_does_not_stop_the_pause(tmp_path, caplog):
    (tmp_path / "paused").write_text("a file where the directory should be")
    marks = PauseMarks(tmp_path / "paused")
    with caplog.at_level(logging.WARNING):
        marks.mark("web")
    assert "resume it by hand" in caplog.text
    assert marks.names() == []


def test_the_guard_marks_what_it_pauses_and_clears_what_it_resumes(tmp_path):
    fabric = make_fabric(tmp_path / "state.db")  # opened as gamma
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    hv.define(domain_of("app", APP, (GPU,)))
    hv.start("app")
    marks = PauseMarks(tmp_path / "paused")
    guard = RemoteVmGuard(hv, fabric, "gamma", marks)
    assert guard.pause() == ["app"]
    assert marks.names() == ["app"]
    guard.resume_if_paused("app")
    assert hv.lookup("app").state is DomainState.RUNNING
    assert marks.names() == []


def test_a_marks_directory_another_user_may_write_to_is_not_used(tmp_path, caplog):
    shared = tmp_path / "paused"
    shared.mkdir()
    marks = PauseMarks(shared)
    marks.mark("web")
    shared.chmod(0o777)  # anyone could plant a mark that makes root resume a VM
    with caplog.at_level(logging.WARNING):
        assert marks.names() == []
        marks.mark("db")
    assert "may write to it" in caplog.text
    linked = PauseMarks(tmp_path / "link")
    os.symlink(shared, tmp_path / "link")
    assert linked.names() == []


def test_clearing_a_vm_that_has_no_mark_says_nothing(tmp_path, caplog):
    marks = PauseMarks(tmp_path / "paused")
    marks.mark("web")
    with caplog.at_level(logging.WARNING):
        marks.clear("db")
        PauseMarks(tmp_path / "none").clear("db")
    assert caplog.text == ""


class SuspendFails(SimHypervisor):
    def suspend(self, name: str) -> None:
        raise LibvirtError("suspend", name, "job timed out")


def test_a_pause_that_failed_leaves_no_mark(tmp_path):
    """A stale mark of a VM that ran on would make the next agent resume an operator's
    later pause of it."""
    fabric = make_fabric(tmp_path / "state.db")
    hv = SuspendFails("gamma", tmp_path / "hv", None)
    hv.define(domain_of("app", APP, (GPU,)))
    hv.start("app")
    marks = PauseMarks(tmp_path / "paused")
    assert not RemoteVmGuard(hv, fabric, "gamma", marks).suspend_if_running("app")
    assert marks.names() == []


class SlowResume(SimHypervisor):
    """A resume that has taken effect and is not back yet, until ``go`` is set."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.resumed = threading.Event()
        self.go = threading.Event()

    def resume(self, name: str) -> None:
        super().resume(name)
        self.resumed.set()
        assert self.go.wait(20)


def test_a_pause_during_a_resume_keeps_its_mark(tmp_path):
    """The renewal resumes app; before that resume has cleared app's mark, the watch pauses
    app again. That pause's mark must survive the resume's clear, or an agent killed now
    leaves app paused for good."""
    fabric = make_fabric(tmp_path / "state.db")
    hv = SlowResume("gamma", tmp_path / "hv", None)
    hv.define(domain_of("app", APP, (GPU,)))
    hv.start("app")
    marks = PauseMarks(tmp_path / "paused")
    guard = RemoteVmGuard(hv, fabric, "gamma", marks)
    guard.suspend_if_running("app")
    resume = threading.Thread(target=guard.resume_if_paused, args=("app",))
    resume.start()
    assert hv.resumed.wait(20)
    pause = threading.Thread(target=guard.suspend_if_running, args=("app",))
    pause.start()
    pause.join(0.5)  # unguarded, the pause is done by now; guarded, it waits for the resume
    hv.go.set()
    resume.join(20)
    pause.join(20)
    assert hv.lookup("app").state is DomainState.PAUSED
    assert marks.names() == ["app"]


def test_at_start_up_only_vms_still_paused_keep_their_marks(tmp_path):
    fabric = make_fabric(tmp_path / "state.db")
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    for n, name in enumerate(("paused", "resumed-by-hand")):
        hv.define(domain_of(name, f"00000000-0000-4000-8000-{n:012x}", (GPU,)))
        hv.start(name)
    hv.suspend("paused")
    marks = PauseMarks(tmp_path / "paused")
    for name in ("paused", "resumed-by-hand", "gone"):
        marks.mark(name)
    assert RemoteVmGuard(hv, fabric, "gamma", marks).left_paused() == ["paused"]
    assert marks.names() == ["paused"]
