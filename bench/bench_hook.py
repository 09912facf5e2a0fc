"""How long libvirt waits for vmlend's hook: a VM with 4 remote devices, prepare then release.

Printed side by side in one run: the installed hook as libvirtd runs it (a new process,
argv + XML on stdin), a bare interpreter start (the floor any Python hook pays), and the same
work in-process (what vmlend itself costs). Ratios, not absolute thresholds.
"""

from __future__ import annotations

import io
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.fabric.model import MiB
from vmlend.fabric.open import default_topology_text, init_fabric
from vmlend.hook.install import install_hook
from vmlend.hook.main import run

ROUNDS = 15
FDIDS = (0x10, 0x12, 0x21, 0x22)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.db"
        text, source = default_topology_text()
        init_fabric(state, text, source, node="gamma", hostname="bench")
        hook = install_hook(Path(tmp) / "libvirt", state, "gamma").path
        spec = DomainSpec(
            name="bench-vm",
            memory_bytes=4096 * MiB,
            uuid=uuid.uuid4(),
            devices=[DeviceRequest(f) for f in FDIDS],
        )
        xml = new_domain(spec, templates=TemplateSet()).to_bytes()

        def hook_process(op: str, sub: str) -> float:
            t = time.perf_counter()
            subprocess.run([str(hook), "bench-vm", op, sub, "-"], input=xml, check=True)
            return time.perf_counter() - t

        def in_process(op: str, sub: str) -> float:
            t = time.perf_counter()
            code = run(
                ["bench-vm", op, sub, "-"],
                stdin=io.BytesIO(xml),
                stdout=io.BytesIO(),
                environ={"VMLEND_STATE": str(state)},
            )
            assert code == 0
            return time.perf_counter() - t

        def bare() -> float:
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            return time.perf_counter() - t

        rows: dict[str, list[float]] = {k: [] for k in ("prep", "rel", "prep_in", "rel_in", "bare")}
        for _ in range(ROUNDS):  # interleaved so machine noise hits every column alike
            rows["prep"].append(hook_process("prepare", "begin"))
            rows["rel"].append(hook_process("release", "end"))
            rows["prep_in"].append(in_process("prepare", "begin"))
            rows["rel_in"].append(in_process("release", "end"))
            rows["bare"].append(bare())

    floor = median_ms(rows["bare"])
    print(f"hook wall time, VM with {len(FDIDS)} remote devices, median of {ROUNDS} rounds")
    print(f"{'what':38} {'ms':>8} {'x bare python':>14}")
    for label, key in (
        ("bare 'python -c pass'", "bare"),
        ("hook process: prepare begin", "prep"),
        ("hook process: release end", "rel"),
        ("in-process: prepare (vmlend's own work)", "prep_in"),
        ("in-process: release", "rel_in"),
    ):
        ms = median_ms(rows[key])
        print(f"{label:38} {ms:8.1f} {ms / floor:14.2f}")


if __name__ == "__main__":
    main()
