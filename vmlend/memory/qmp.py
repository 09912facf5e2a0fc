"""Read a running QEMU's guest-physical RAM through QMP (``info mtree -f``).

``parse_flat_view`` is pure and turns the HMP text into ranges; :class:`QemuProcess` starts a
paused TCG QEMU for tests and tools (socket in a caller-given directory, stopped by its PID);
:func:`qemu_memory_args` turns a :class:`MemoryConfig` into QEMU's command line so the computed
layout and QEMU's own can be compared.
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
from qemu.qmp.legacy import QEMUMonitorProtocol

from vmlend.errors import HostError, LayoutError
from vmlend.memory.layout import CpuVendor, MemoryConfig, merge_ranges
from vmlend.safefile import socket_path_problem
from vmlend.topology.model import GuestRange

log = logging.getLogger(__name__)

_LINE = re.compile(
    r"^\s*(?P<start>[0-9a-f]+)-(?P<end>[0-9a-f]+)\s+\(prio\s+(?P<prio>-?\d+),\s*"
    r"(?P<kind>[^)]+)\):\s*(?P<name>.*?)\s*$"
)


class FlatRange(msgspec.Struct, frozen=True):
    """One line of a flat view: [start, end) of ``kind`` (ram, rom, i/o, romd, ...)."""

    start: int
    end: int
    kind: str
    name: str
    prio: int


def parse_flat_view(text: str, address_space: str = "memory") -> list[FlatRange]:
    """The ranges of the flat view that serves ``address_space`` in ``info mtree -f`` output."""
    lines = text.splitlines()
    wanted = f'AS "{address_space}"'
    in_view = False
    seen = False
    out: list[FlatRange] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("FlatView #"):
            if seen:
                break
            in_view = False
            continue
        if stripped.startswith('AS "'):
            if stripped.split(",")[0] == wanted:
                in_view = seen = True
            continue
        if not in_view:
            continue
        m = _LINE.match(line)
        if m:
            # mtree prints inclusive ends
            out.append(
                FlatRange(
                    start=int(m["start"], 16),
                    end=int(m["end"], 16) + 1,
                    kind=m["kind"].strip(),
                    name=m["name"],
                    prio=int(m["prio"]),
                )
            )
    if not seen:
        raise LayoutError(f"no flat view for address space {address_space!r} in mtree output")
    return out


def ram_ranges(flat: list[FlatRange], merge: bool = True) -> list[GuestRange]:
    """The RAM of a flat view; adjacent RAM pieces (NUMA backends, aliases) merged if asked."""
    ram = [GuestRange(r.start, r.end) for r in flat if r.kind == "ram"]
    return merge_ranges(ram) if merge else ram


def qemu_memory_args(cfg: MemoryConfig) -> list[str]:
    """QEMU options that give a guest the memory ``cfg`` describes (as libvirt would)."""
    machine = cfg.machine
    if cfg.max_ram_below_4g is not None:
        machine += f",max-ram-below-4g={cfg.max_ram_below_4g}"
    mem = f"size={cfg.ram // 1024}k"
    if cfg.maxmem > cfg.ram:
        mem += f",slots={cfg.slots},maxmem={cfg.maxmem // 1024}k"
    args = ["-machine", machine, "-m", mem]
    if cfg.cpu_vendor is CpuVendor.AMD:
        # phys-bits 48 so QEMU accepts address spaces past 1 TiB under TCG
        args += ["-cpu", "EPYC,phys-bits=48"]
    elif cfg.cpu_vendor is CpuVendor.INTEL:
        args += ["-cpu", "Skylake-Client,phys-bits=48"]
    elif cfg.cpu_vendor is CpuVendor.OTHER:
        args += ["-cpu", "Dhyana,phys-bits=48"]
    if cfg.pci_hole64_size is not None:
        host = "q35-pcihost" if "q35" in cfg.machine else "i440FX-pcihost"
        args += ["-global", f"{host}.pci-hole64-size={cfg.pci_hole64_size}"]
    for n, size in enumerate(cfg.numa_cells):
        args += ["-object", f"memory-backend-ram,id=ram-node{n},size={size}"]
        args += ["-numa", f"node,nodeid={n},memdev=ram-node{n}"]
    for n, dimm in enumerate(cfg.dimms):
        args += ["-object", f"memory-backend-ram,id=dimm{n}m,size={dimm.size}"]
        dev = f"pc-dimm,id=dimm{n},memdev=dimm{n}m"
        if dimm.base is not None:
            dev += f",addr={dimm.base}"
        if dimm.node is not None and cfg.numa_cells:
            dev += f",node={dimm.node}"
        args += ["-device", dev]
    return args


class QemuProcess:
    """A paused TCG QEMU with a QMP unix socket in ``run_dir``; a context manager.

    Stopped by its own PID (terminate, then kill) on exit. ``extra`` adds QEMU options.
    """

    def __init__(
        self,
        run_dir: Path,
        args: list[str],
        binary: str = "qemu-system-x86_64",
        timeout: float = 10.0,
    ) -> None:
        exe = shutil.which(binary)
        if exe is None:
            raise HostError(f"{binary} not found; install qemu-system-x86")
        self.binary = exe
        self.run_dir = Path(run_dir)
        self.args = list(args)
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._qmp: QEMUMonitorProtocol | None = None

    def __enter__(self) -> QemuProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        sock = self.run_dir / f"qmp-{id(self):x}.sock"
        if socket_path_problem(sock) is not None:
            raise HostError(
                f"QMP socket path {sock} is too long for a unix socket; use a shorter run_dir"
            )
        sock.unlink(missing_ok=True)
        # QEMU is the QMP server: if it dies before listening we see it exit instead of
        # waiting for a connection that never comes.
        cmd = [self.binary, "-accel", "tcg", "-S", "-nodefaults", "-display", "none"]
        cmd += ["-qmp", f"unix:{sock},server=on,wait=off", *self.args]
        log.debug("starting %s", " ".join(cmd))
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + self.timeout
        try:
            self._qmp = self._connect(sock, deadline)
        except Exception as exc:
            err = self._stop_and_collect()
            raise HostError(f"QEMU did not start ({' '.join(self.args)}): {err or exc}") from None
        finally:
            sock.unlink(missing_ok=True)  # connected (or failed): the path is no longer needed

    def _connect(self, sock: Path, deadline: float) -> QEMUMonitorProtocol:
        """Connect once QEMU listens; the socket file appears a moment before listen()."""
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise HostError(f"QEMU exited with status {self.proc.returncode}")
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(str(sock))
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
            else:
                qmp = QEMUMonitorProtocol(conn)
                qmp.connect()
                return qmp
            if time.monotonic() > deadline:
                raise HostError(f"QEMU did not open its QMP socket within {self.timeout} s")
            time.sleep(0.002)

    def qmp(self, command: str, arguments: dict[str, object] | None = None) -> Any:
        """The ``return`` value of a QMP command; HostError when QEMU refuses it."""
        if self._qmp is None:
            raise HostError("QEMU is not running")
        reply = self._qmp.cmd_raw(command, arguments)
        if "error" in reply:
            raise HostError(f"QEMU refused {command}: {reply['error'].get('desc')}")
        return reply["return"]

    def hmp(self, command: str) -> str:
        if self._qmp is None:
            raise HostError("QEMU is not running")
        reply = self._qmp.cmd_raw("human-monitor-command", {"command-line": command})
        if "error" in reply:
            raise HostError(f"QEMU refused {command!r}: {reply['error'].get('desc')}")
        return str(reply["return"])

    def ram_ranges(self, merge: bool = True) -> list[GuestRange]:
        """Guest RAM as QEMU's flat view of the "memory" address space shows it."""
        return ram_ranges(parse_flat_view(self.hmp("info mtree -f")), merge=merge)

    def _stop_and_collect(self) -> str:
        if self._qmp is not None:
            try:
                self._qmp.close()
            except Exception:  # closing a half-open socket may fail; the PID stop follows
                log.debug("closing QMP failed", exc_info=True)
            self._qmp = None
        err = ""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(self.timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            if self.proc.stderr is not None:
                err = self.proc.stderr.read().decode(errors="replace").strip()
                self.proc.stderr.close()
            self.proc = None
        return err

    def stop(self) -> None:
        self._stop_and_collect()
