"""The demo's parts without hook subprocesses: interrupt wiring, the run loop, the report."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.support.fdcheck import fd_snapshot, leaked
from tests.support.irq_devices import make_device, msix_flags, msix_program
from vmlend.demo import Step, StepResult, render_step, run_demo
from vmlend.demo.cluster import DemoCluster
from vmlend.demo.interrupts import VmInterrupts
from vmlend.errors import DemoError, StateError
from vmlend.irq.vectors import IrqIndex
from vmlend.wiring.fabric import default_topology_text, init_fabric


def msix_device(vectors: int = 4):
    """A device lent by alpha with MSI-X enabled and every entry unmasked, as a guest leaves it."""
    dev = make_device(msix_entries=vectors)
    for v in range(vectors):
        msix_program(dev.bars, v)
    msix_flags(dev.config, enable=True)
    return dev


@pytest.mark.parametrize(
    ("vm_node", "path"), [("gamma", "relay alpha->gamma"), ("alpha", "vfio (local)")]
)
def test_interrupts_reach_the_vm_eventfds_relayed_or_local(vm_node, path):
    before = fd_snapshot()
    threads = threading.active_count()
    dev = msix_device()
    irqs = VmInterrupts(vm_node)
    try:
        wired = irqs.wire(dev, IrqIndex.MSIX, 4)
        assert wired.path == path and wired.json()["vectors"] == 4
        got = irqs.fire(dev, 103)
        assert got == [26, 26, 26, 25]
        assert irqs.wire(dev, IrqIndex.MSIX, 4) is wired  # wiring twice changes nothing
        irqs.unwire(dev.fdid)
        assert irqs.devices == {}
        irqs.unwire(dev.fdid)  # idempotent
    finally:
        irqs.close()
    assert threading.active_count() == threads
    assert not leaked(before)


def test_an_unwired_device_raises_into_nothing():
    dev = msix_device(2)
    irqs = VmInterrupts("gamma")
    try:
        with pytest.raises(KeyError):
            irqs.fire(dev, 1)
    finally:
        irqs.close()


def _step(key: str, fail: bool = False) -> Step:
    def run(_story) -> dict:
        if fail:
            raise DemoError(f"{key} did not hold")
        return {"key": key}

    return Step(key, f"step {key}", run)


def test_the_run_stops_at_the_first_failure_and_reports_each_step(tmp_path: Path):
    seen: list[StepResult] = []
    ticks = iter(range(100))
    result = run_demo(
        tmp_path / "state.db",
        steps=[_step("a"), _step("b", fail=True), _step("c")],
        on_step=seen.append,
        clock=lambda: float(next(ticks)),
    )
    assert [s.key for s in seen] == ["a", "b"]
    assert not result.ok and result.error == "step 2 (b): b did not hold"
    doc = result.json()
    assert doc["ok"] is False and [s["ok"] for s in doc["steps"]] == [True, False]
    assert doc["steps"][0]["data"] == {"key": "a"} and doc["steps"][0]["seconds"] == 1.0
    assert render_step(seen[1]).splitlines() == ["== 2. step b  (1.0 s)", "FAILED: b did not hold"]


def test_no_steps_is_not_a_success(tmp_path: Path):
    assert not run_demo(tmp_path / "state.db", steps=[]).ok


def test_a_bug_in_a_step_is_not_swallowed(tmp_path: Path):
    def broken(_story) -> dict:
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        run_demo(tmp_path / "state.db", steps=[Step("x", "x", broken)])


def test_cleanup_on_a_clean_state_does_nothing(tmp_path: Path):
    state = tmp_path / "state.db"
    text, source = default_topology_text()
    init_fabric(state, text, source, node="gamma")
    cluster = DemoCluster(state)
    try:
        assert cluster.remove_vm("demo") == []
        assert cluster.hook_calls == []
        assert cluster.hypervisor("gamma").uri == "sim:///gamma"
        assert cluster.hypervisor("gamma") is cluster.hypervisor("gamma")
    finally:
        cluster.close()


def test_a_cluster_needs_an_initialised_state(tmp_path: Path):
    with pytest.raises(StateError):
        DemoCluster(tmp_path / "missing.db")


def test_a_step_leaving_an_unjustified_mapping_fails_the_run(tmp_path: Path):
    from vmlend.demo.steps import fabric_step

    def stale(story) -> dict:
        # a device nobody borrowed keeps a mapping into the NVMe's BAR (a leaked P2P map)
        hw = story.c.hw
        hw.lender_domain(0x10).map(0x1000_0000, hw.device(0x12).bar_range(0)[0], 4096)
        return {}

    result = run_demo(
        tmp_path / "state.db",
        steps=[Step("fabric", "fabric", fabric_step), Step("stale", "stale", stale)],
    )
    assert [s.ok for s in result.steps] == [True, False]
    assert result.error is not None
    assert "fabric invariant violated: lender-iommu alpha:dev0x10" in result.error
    assert "device 0x10 is not borrowed" in result.error
