"""How long libvirt waits for vmlend's hook, and how long `vmlend` takes to answer.

Printed side by side in one run, as ratios to a bare interpreter start (`python -c pass`, the
floor any Python hook pays) measured in the same rounds: the installed hook as libvirtd runs
it (a new process, argv + XML on stdin) for a plain domain, for an operation vmlend ignores,
and for prepare/release of a VM with 4 remote devices; the same prepare/release in-process
(what vmlend's own work costs); `vmlend --help` and `vmlend devices`; then, in a second phase
(a hook never runs a call beside a live agent), the same hook calls served by a `vmlend agent`
(SQLite, hook server only) that the bench starts and stops by its PID, as libvirtd runs them
(no VMLEND_* settings: the script pins its configuration file), and the served prepare split
by step: the interpreter start, the hook's imports up to the forward, the forward's round trip
(socket and the agent's work) measured from this process.
Then an import-time breakdown (`-X importtime`) of the hook's prepare: what the remaining time
goes to.

Bytecode is compiled first (as `pip install` does): a run under PYTHONDONTWRITEBYTECODE would
otherwise compile every module from source in every process and measure the compiler.
"""

from __future__ import annotations

import argparse
import compileall
import io
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

import vmlend
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.hook.actionlog import log_path_for_state
from vmlend.hook.forward import forward_unconfigured
from vmlend.hook.install import install_hook, read_script_pins
from vmlend.hook.main import run
from vmlend.hostenv import HostEnv
from vmlend.registry import hostlease
from vmlend.topology.model import MiB
from vmlend.wiring.fabric import default_topology_text, init_fabric

FDIDS = (0x10, 0x12, 0x21, 0x22)
PLAIN_XML = b"<domain type='kvm'><name>plain</name><memory unit='KiB'>65536</memory></domain>"
GOALS = {
    "plain": 1.3,
    "ignored": 1.3,
    "prep": 2.0,
    "rel": 2.0,
    "prep_agent": 1.0,
    "rel_agent": 2.0,
    "help": 3.0,
    "devices": 3.0,
}


class Sample(NamedTuple):
    wall: float
    cpu: float


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str], stdin: bytes = b"", env: dict[str, str] | None = None) -> Sample:
    """Wall time and the child's CPU time (user + system): on a machine others share, CPU
    time is the steadier of the two."""
    t, c = time.perf_counter(), child_cpu()
    subprocess.run(argv, input=stdin, check=True, env=env, stdout=subprocess.DEVNULL)
    return Sample(time.perf_counter() - t, child_cpu() - c)


def process_cpu(pid: int) -> float:
    """CPU seconds all threads of process ``pid`` ran so far (``schedstat``: nanoseconds, not
    the 10 ms ticks of ``stat``)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with suppress(OSError, ValueError, IndexError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def log_lines(state: Path) -> list[str]:
    return log_path_for_state(state).read_text().splitlines()


def table(
    title: str,
    columns: dict[str, tuple[str, Callable[[], Sample]]],
    rows: dict[str, list[Sample]],
    rounds: int,
) -> None:
    wall_floor = median_ms([s.wall for s in rows["bare"]])
    cpu_floor = median_ms([s.cpu for s in rows["bare"]])
    print(f"\n{title}: median of {rounds} interleaved rounds; ratios to the bare start")
    print(f"{'what':40} {'wall ms':>8} {'x bare':>7} {'cpu ms':>8} {'x bare':>7} {'goal':>6}")
    for key, (label, _m) in columns.items():
        wall = median_ms([s.wall for s in rows[key]])
        cpu = median_ms([s.cpu for s in rows[key]])
        goal = f"<={GOALS[key]}" if key in GOALS else ""
        print(
            f"{label:40} {wall:8.1f} {wall / wall_floor:7.2f} {cpu:8.1f} "
            f"{cpu / cpu_floor:7.2f} {goal:>6}"
        )


def installed_roots(hook: str) -> list[str]:
    from vmlend.hook.install import read_roots

    return read_roots(Path(hook).read_text())


def script_pins(hook: str) -> dict[str, str]:
    """The environment the installed script gives itself (its file and root)."""
    pins = read_script_pins(Path(hook).read_text())
    return {"VMLEND_CONFIG": pins["config"], "VMLEND_ROOT": pins["root"]}


def import_breakdown(argv: list[str], stdin: bytes, env: dict[str, str], top: int) -> None:
    """The modules ``python ARGV`` imports, by self time, and the top-level entries by total."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", *argv], input=stdin, env=env, capture_output=True
    )
    rows = []
    for line in out.stderr.decode().splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((int(m.group(1)), int(m.group(2)), len(m.group(3)), m.group(4)))
    total = sum(r[0] for r in rows) / 1000
    print(f"\nimport time of the hook's prepare: {len(rows)} modules, {total:.1f} ms in all")
    print(f"  top {top} top-level imports (cumulative ms)")
    for _self, cum_us, _depth, name in sorted((r for r in rows if r[2] == 1), key=lambda r: -r[1])[
        :top
    ]:
        print(f"    {cum_us / 1000:7.1f}  {name}")
    print(f"  top {top} modules by their own time (ms)")
    for self_us, _cum, _depth, name in sorted(rows, key=lambda r: -r[0])[:top]:
        print(f"    {self_us / 1000:7.1f}  {name}")


@contextmanager
def hook_agent(cli: str, env: dict[str, str], sock: Path, log: Path) -> Iterator[int]:
    """``vmlend agent`` serving the hook on ``sock``, stopped by its PID on exit."""
    with log.open("ab") as out:
        agent = subprocess.Popen(
            [cli, "agent"], env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL
        )
    try:
        deadline = time.monotonic() + 30
        while not _accepts(sock):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the agent did not serve the hook: {log.read_text()}")
            time.sleep(0.05)
        yield agent.pid
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)


def _accepts(sock: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--top", type=int, default=12, help="rows of the import breakdown")
    args = ap.parse_args()
    compileall.compile_dir(Path(vmlend.__file__).parent, quiet=1)
    cli = str(Path(sys.executable).with_name("vmlend"))
    with tempfile.TemporaryDirectory() as tmp:
        # The hook's configuration file pins paths under its host root: the state lives there.
        root = Path(tmp) / "root"
        state = HostEnv(root).system_state
        state.parent.mkdir(parents=True)
        text, source = default_topology_text()
        init_fabric(state, text, source, node="gamma", hostname="bench")
        sock = hostlease.hook_socket_path(HostEnv(root))
        # backend = "sim": libvirtd (the hook script's caller) may run simulated devices here.
        installed = install_hook(
            Path(tmp) / "libvirt", state, "gamma", hook_socket=sock, backend="sim", root=root
        )
        hook = str(installed.path)
        base = {k: v for k, v in os.environ.items() if not k.startswith("VMLEND_")}
        base |= {"VMLEND_STATE": str(state), "VMLEND_NODE": "gamma", "VMLEND_ROOT": str(root)}
        # The in-process rows: the pinned socket overridden by one no agent serves.
        env = base | {"VMLEND_HOOK_SOCKET": str(Path(tmp) / "no-agent.sock")}
        spec = DomainSpec(
            name="bench-vm",
            memory_bytes=4096 * MiB,
            uuid=uuid.uuid4(),
            devices=[DeviceRequest(f) for f in FDIDS],
        )
        xml = new_domain(spec, templates=TemplateSet()).to_bytes()

        def in_process(op: str, sub: str) -> Sample:
            t, c = time.perf_counter(), time.process_time()
            code = run(
                ["bench-vm", op, sub, "-"],
                stdin=io.BytesIO(xml),
                stdout=io.BytesIO(),
                environ={"VMLEND_STATE": str(state)},
            )
            assert code == 0
            return Sample(time.perf_counter() - t, time.process_time() - c)

        bare = ("bare 'python -c pass'", lambda: timed([sys.executable, "-c", "pass"]))
        bare_is = (
            "bare 'python -I -S -c pass'",
            lambda: timed([sys.executable, "-I", "-S", "-c", "pass"]),
        )
        # Phase 1, no agent: a hook never runs a call beside a live agent (it waits for it,
        # then fails), so the in-process rows are measured while none runs.
        alone: dict[str, tuple[str, Callable[[], Sample]]] = {
            "bare": bare,
            "bare_is": bare_is,
            "plain": (
                "hook: plain domain, prepare",
                lambda: timed([hook, "plain", "prepare", "begin", "-"], PLAIN_XML, env),
            ),
            "ignored": (
                "hook: vmlend VM, 'started begin'",
                lambda: timed([hook, "bench-vm", "started", "begin", "-"], xml, env),
            ),
            "prep": (
                f"hook: {len(FDIDS)}-device VM, prepare",
                lambda: timed([hook, "bench-vm", "prepare", "begin", "-"], xml, env),
            ),
            "rel": (
                f"hook: {len(FDIDS)}-device VM, release",
                lambda: timed([hook, "bench-vm", "release", "end", "-"], xml, env),
            ),
            "prep_in": (
                "in-process: prepare (vmlend's work)",
                lambda: in_process("prepare", "begin"),
            ),
            "rel_in": ("in-process: release", lambda: in_process("release", "end")),
            "help": ("vmlend --help", lambda: timed([cli, "--help"], env=env)),
            "devices": ("vmlend devices", lambda: timed([cli, "devices"], env=env)),
        }
        # The hook as libvirtd runs it: no VMLEND_* of its own, the script pins its file.
        libvirtd_env = {k: v for k, v in base.items() if not k.startswith("VMLEND_")}
        # what the installed script imports before it sends the call (entry, prefilter, forward)
        steps = ["import sys", f"sys.path[:0] = {installed_roots(hook)!r}", "import os"]
        steps += ["import vmlend.hook.entry", "import vmlend.hook.forward"]

        def round_trip(op: str, sub: str) -> Sample:
            """The hook's forward alone, from this process: the socket and the agent's work."""
            t = time.perf_counter()
            code = forward_unconfigured(
                ["bench-vm", op, sub, "-"], xml, libvirtd_env | script_pins(hook)
            )
            assert code == 0
            return Sample(time.perf_counter() - t, 0.0)

        # Phase 2, the agent serving the hook; and the served prepare split by step.
        served: dict[str, tuple[str, Callable[[], Sample]]] = {
            "bare": bare,
            "prep_agent": (
                f"hook via agent: {len(FDIDS)}-device VM, prepare",
                lambda: timed([hook, "bench-vm", "prepare", "begin", "-"], xml, libvirtd_env),
            ),
            "rel_agent": (
                f"hook via agent: {len(FDIDS)}-device VM, release",
                lambda: timed([hook, "bench-vm", "release", "end", "-"], xml, libvirtd_env),
            ),
            "step_start": ("  step 1: interpreter start (-I -S)", bare_is[1]),
            "step_imports": (
                "  step 2: + the hook's imports to forward",
                lambda: timed([sys.executable, "-I", "-S", "-c", "; ".join(steps)]),
            ),
            "step_trip": (
                "  step 3: the forward (socket + agent)",
                lambda: round_trip("prepare", "begin"),
            ),
            "step_trip_rel": (
                "  (its release, to undo step 3)",
                lambda: round_trip("release", "end"),
            ),
        }
        rows: dict[str, list[Sample]] = {k: [] for k in alone}
        for _ in range(args.rounds):  # interleaved so machine noise hits every column alike
            for key, (_label, measure) in alone.items():
                rows[key].append(measure())
        table("without an agent", alone, rows, args.rounds)
        rows = {k: [] for k in served}
        with hook_agent(cli, base, sock, Path(tmp) / "agent.log") as agent_pid:
            for _ in range(args.rounds):
                for key, (_label, measure) in served.items():
                    before = process_cpu(agent_pid)
                    sample = measure()
                    if key.endswith(("_agent", "_trip", "_rel")):  # the host pays the agent's CPU
                        sample = sample._replace(cpu=sample.cpu + process_cpu(agent_pid) - before)
                    rows[key].append(sample)
        served_calls = sum(f"pid={agent_pid} " in line for line in log_lines(state))
        if served_calls < 4 * args.rounds:
            raise SystemExit("the agent did not serve every call: the 'via agent' rows are wrong")
        table("with the agent serving the hook", served, rows, args.rounds)
        print(
            "'hook via agent': the hook process forwards to the bench's agent, which runs the"
            " call; its cpu column is the hook process's CPU plus the agent's for that call."
            " Steps 1-3 add up to the served prepare (step 3's wall is the socket round trip"
            " and the agent's work, its cpu the agent's)"
        )

        # The installed script's shebang runs the interpreter with -IS: so does the breakdown.
        argv = ["-I", "-S", hook, "bench-vm", "prepare", "begin", "-"]
        import_breakdown(argv, xml, env, args.top)
        subprocess.run([hook, "bench-vm", "release", "end", "-"], input=xml, env=env, check=True)


if __name__ == "__main__":
    main()
