"""Cost of one domain life cycle (define, start, destroy, undefine) on each hypervisor, side by
side in one run: libvirt's test driver, the simulated node without a hook, and with a hook
(the recording shell script, i.e. one fork+exec per hook call as libvirtd does).

Prints milliseconds per cycle and the ratios; asserts nothing."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from vmlend.wiring.hypervisor import open_hypervisor

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "hypervisor"
DOMAIN_XML = (DATA / "domain.xml").read_bytes()
ROUNDS = 30


def cycle_ms(uri: str, state: Path, hook: list[str] | None) -> float:
    hv = open_hypervisor(uri, state_dir=state, hook_command=hook)
    t0 = time.perf_counter()
    for _ in range(ROUNDS):
        hv.define(DOMAIN_XML)
        hv.start("vm1")
        hv.destroy("vm1")
        hv.undefine("vm1")
    elapsed = time.perf_counter() - t0
    hv.close()
    return elapsed / ROUNDS * 1000


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        os.environ["HOOK_LOG"] = str(state / "hook.log")
        hook = [shutil.which("sh") or "sh", str(DATA / "recording-hook.sh")]
        rows = [
            ("libvirt test driver", cycle_ms(f"test://{DATA / 'node.xml'}", state, None)),
            ("sim, no hook", cycle_ms("sim:///bench-a", state, None)),
            ("sim, recording hook", cycle_ms("sim:///bench-b", state, hook)),
        ]
    base = rows[0][1]
    print(f"{'hypervisor':<22} {'ms/cycle':>9} {'vs test driver':>15}")
    for name, ms in rows:
        print(f"{name:<22} {ms:>9.2f} {ms / base:>14.1f}x")
    print(f"({ROUNDS} cycles of define+start+destroy+undefine each; the hook runs 5 times a cycle)")


if __name__ == "__main__":
    main()
