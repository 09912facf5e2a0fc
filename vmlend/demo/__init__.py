"""``vmlend demo``: the whole story on the simulated cluster, as a report.

A VM on gamma gets two GPUs (from alpha and beta) and an NVMe drive; the real hook reserves them
when it starts, the guest's enable borrows them and maps its DMA windows, interrupts and
peer-to-peer DMA flow, a VF is hot-added and removed through ``vmlend attach``/``detach``'s code,
the VM is cold-migrated to alpha through ``vmlend migrate``'s code and works there, and when it
stops everything is returned. ``run_demo`` runs it; ``render_step`` turns a step into text.
"""

from vmlend.demo.context import DemoConfig
from vmlend.demo.report import render_step
from vmlend.demo.steps import STEPS, Step
from vmlend.demo.story import DemoResult, StepResult, run_demo

__all__ = ["STEPS", "DemoConfig", "DemoResult", "Step", "StepResult", "render_step", "run_demo"]
