"""A private, real virtlogd + libvirtd for tests, and the pytest fixtures around it.

As root, libvirtd's qemu driver, its hook directory (/etc/libvirt/hooks) and the virtlogd
socket path are compiled in; no option or environment variable moves them. So each daemon
runs in its own mount namespace in which private directories are bind-mounted over the
system ones (see SYSTEM_DIRS). The daemons, and the QEMU processes they spawn, see only the
private tree; the host and any system libvirtd are untouched. The unix sockets land in the
private run directory, which the tests reach from outside the namespace by its real path.

Register with ``pytest_plugins = ["tests.support.libvirt_daemon"]``. Fixtures:
  libvirtd       session: the running LibvirtDaemon (one per test session, ~1 s to start)
  libvirt_conn   a libvirt connection to it, closed after the test
  hook_recorder  installs tests/data/libvirtd/record_hook.py as the qemu hook for one test
  libvirt_guests defines TCG guests and destroys/undefines them (and checks QEMU exited)
Plugging in another hook (e.g. vmlend's): ``libvirtd.install_hook([exe, ...], env={...})``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from lxml import etree

from tests.support.needs import need
from tests.support.paths import DATA

log = logging.getLogger(__name__)

DATA_DIR = DATA / "libvirtd"
TRAMPOLINE = DATA_DIR / "trampoline.sh"
RECORD_HOOK = DATA_DIR / "record_hook.py"
REAPER = DATA_DIR / "reaper.py"
GUEST_XML = DATA_DIR / "guest.xml"
MDEV_HOSTDEV_XML = DATA_DIR / "mdev-hostdev.xml"

# Private subdirectory -> the system directory it replaces inside the daemons' namespace.
SYSTEM_DIRS: dict[str, str] = {
    "etc": "/etc/libvirt",
    "run": "/run/libvirt",
    "lib": "/var/lib/libvirt",
    "log": "/var/log/libvirt",
    "cache": "/var/cache/libvirt",
}

START_TIMEOUT = 30.0  # a socket that is not there after this is a broken daemon
STOP_TIMEOUT = 10.0  # SIGTERM grace before SIGKILL
UNIX_PATH_MAX = 108  # sun_path, including the terminating NUL


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.02
) -> float:
    """Poll ``predicate`` until true; return the seconds it took, raise TimeoutError after."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"{what} not ready after {timeout:g} s")
        time.sleep(interval)
    return time.monotonic() - start


def socket_accepts(path: Path) -> bool:
    """True when a unix stream socket at ``path`` accepts a connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def pid_alive(pid: int) -> bool:
    """True while ``pid`` names a process that is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # The state letter follows the parenthesised command name, which may contain spaces.
    return stat[stat.rindex(")") + 2] not in "ZX"


def render_conf(values: Mapping[str, str | int | Sequence[str]]) -> str:
    """A libvirt .conf file (key = value lines) from a mapping."""

    def quote(text: str) -> str:
        if '"' in text or "\n" in text:
            raise ValueError(f"cannot quote {text!r} for a libvirt config file")
        return f'"{text}"'

    lines = []
    for key, value in values.items():
        if isinstance(value, int):
            rendered = str(value)
        elif isinstance(value, str):
            rendered = quote(value)
        else:
            rendered = "[" + ", ".join(quote(v) for v in value) + "]"
        lines.append(f"{key} = {rendered}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class DaemonLayout:
    """Every path of one private daemon, hanging off ``root`` (pure: touches nothing).
    ``fixed_uuid``: the host UUID libvirtd reports, when a test chooses it; else one derived
    from ``root`` (two daemons on one machine must differ, or libvirt refuses a migration
    between them as "to the same host", and vmlend tells hypervisors apart by it)."""

    root: Path
    fixed_uuid: str | None = None

    def private(self, name: str) -> Path:
        return self.root / name

    @property
    def config_dir(self) -> Path:
        return self.private("etc")

    @property
    def hooks_dir(self) -> Path:
        return self.config_dir / "hooks"

    @property
    def run_dir(self) -> Path:
        return self.private("run")

    @property
    def log_dir(self) -> Path:
        return self.private("log")

    @property
    def socket(self) -> Path:
        return self.run_dir / "libvirt-sock"

    @property
    def virtlogd_socket(self) -> Path:
        return self.run_dir / "virtlogd-sock"

    @property
    def libvirtd_log(self) -> Path:
        return self.log_dir / "libvirtd.log"

    @property
    def uri(self) -> str:
        return f"qemu+unix:///system?socket={self.socket}"

    def binds(self, cache_dir: Path | None = None) -> list[tuple[Path, str]]:
        """(private source, system target) pairs; ``cache_dir`` may replace the cache."""
        pairs = [(self.private(name), target) for name, target in SYSTEM_DIRS.items()]
        if cache_dir is not None:
            pairs = [(cache_dir if t == SYSTEM_DIRS["cache"] else s, t) for s, t in pairs]
        return pairs

    @property
    def host_uuid(self) -> str:
        """The test's choice, else stable for this daemon's root and distinct between daemons."""
        if self.fixed_uuid is not None:
            return self.fixed_uuid
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"vmlend-test-libvirtd:{self.root}"))

    def config_files(self) -> dict[Path, str]:
        """The config files the daemons read, with their content."""
        libvirtd = {
            # Root on a 0700 socket: no polkit (there is no D-Bus here) and no other user.
            "auth_unix_rw": "none",
            "auth_unix_ro": "none",
            "unix_sock_rw_perms": "0700",
            "unix_sock_ro_perms": "0700",
            "unix_sock_admin_perms": "0700",
            # Hook failures are logged as errors; util.hook debug shows every hook run.
            "log_filters": "1:util.hook",
            "log_outputs": f"3:file:{self.libvirtd_log}",
            # Its own host UUID (not the machine's SMBIOS one): two private daemons on this
            # machine are two hypervisors to vmlend (vmlend.ops.hvidentity).
            "host_uuid": self.host_uuid,
        }
        virtlogd = {"log_outputs": f"3:file:{self.log_dir / 'virtlogd.log'}"}
        qemu = {
            # Guests run as root so private dirs need no chown to libvirt-qemu, and libvirt
            # creates no cgroups: nothing outside the private tree changes.
            "user": "root",
            "group": "root",
            "cgroup_controllers": [],
        }
        return {
            self.config_dir / "libvirtd.conf": render_conf(libvirtd),
            self.config_dir / "virtlogd.conf": render_conf(virtlogd),
            self.config_dir / "qemu.conf": render_conf(qemu),
        }


def _namespace_setup(binds: Sequence[tuple[Path, str]]) -> Callable[[], None]:
    """A ``preexec_fn``: new mount namespace, private propagation, the bind mounts.

    Runs in the forked child just before exec, so the daemon itself (and the PID Popen
    reports) lives in the namespace; nothing mounted there is visible outside.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_bind, ms_rec, ms_private = 0x20000, 0x1000, 0x4000, 0x40000
    pr_set_pdeathsig = 1

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def setup() -> None:
        check(libc.unshare(clone_newns), "unshare(CLONE_NEWNS)")
        check(libc.mount(b"none", b"/", None, ms_rec | ms_private, None), "make / private")
        for source, target in binds:
            check(
                libc.mount(os.fsencode(source), os.fsencode(target), None, ms_bind | ms_rec, None),
                f"bind {source} over {target}",
            )
        # If pytest dies without teardown, the daemon gets SIGTERM instead of lingering.
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)

    return setup


def stop_pid(pid: int, timeout: float = STOP_TIMEOUT, proc: subprocess.Popen | None = None) -> bool:
    """SIGTERM ``pid``, wait, SIGKILL if needed; True if it had to be killed."""
    if not pid_alive(pid):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False

    def gone() -> bool:
        if proc is not None:
            proc.poll()  # reap our own child so it does not stay a zombie
        return not pid_alive(pid)

    try:
        wait_for(gone, timeout, f"exit of pid {pid}")
        return False
    except TimeoutError:
        log.warning("pid %d ignored SIGTERM for %.0f s, killing it", pid, timeout)
        os.kill(pid, signal.SIGKILL)
        wait_for(gone, timeout, f"exit of killed pid {pid}")
        return True


@dataclass
class LibvirtDaemon:
    """A private virtlogd + libvirtd under ``root``; ``start()`` / ``stop()`` by PID."""

    root: Path
    cache_dir: Path | None = None  # another daemon's QEMU capability cache, to skip the probe
    host_uuid: str | None = None  # see DaemonLayout
    layout: DaemonLayout = field(init=False)
    timings: dict[str, float] = field(default_factory=dict)
    # Our children: "virtlogd" and "libvirtd", the latter being the reaper that runs it.
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _libvirtd_pid: int | None = None

    def __post_init__(self) -> None:
        self.layout = DaemonLayout(self.root, self.host_uuid)

    # -- what tests use -----------------------------------------------------------------
    @property
    def uri(self) -> str:
        return self.layout.uri

    @property
    def hooks_dir(self) -> Path:
        return self.layout.hooks_dir

    @property
    def log_dir(self) -> Path:
        return self.layout.log_dir

    @property
    def pids(self) -> dict[str, int]:
        """virtlogd, libvirtd and the reaper process that is libvirtd's parent."""
        found = {}
        if "virtlogd" in self._procs:
            found["virtlogd"] = self._procs["virtlogd"].pid
        if "libvirtd" in self._procs:
            found["reaper"] = self._procs["libvirtd"].pid
        if self._libvirtd_pid is not None:
            found["libvirtd"] = self._libvirtd_pid
        return found

    def connect(self):
        """A new read-write ``libvirt.virConnect`` to this daemon (caller closes it)."""
        import libvirt

        # libvirt-python prints every error to stderr by default; tests read exceptions.
        libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
        return libvirt.open(self.uri)

    def read_log(self) -> str:
        """libvirtd's own log (errors, hook runs)."""
        path = self.layout.libvirtd_log
        return path.read_text(errors="replace") if path.exists() else ""

    def domain_log(self, name: str) -> str:
        """The QEMU log of domain ``name`` (written through virtlogd)."""
        path = self.log_dir / "qemu" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def qemu_pids(self) -> dict[str, int]:
        """Domain name -> QEMU pid, from the pid files of running domains."""
        found = {}
        for pidfile in (self.layout.run_dir / "qemu").glob("*.pid"):
            text = pidfile.read_text().strip()
            if text.isdigit():
                found[pidfile.stem] = int(text)
        return found

    def install_hook(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        """Make the trampoline run ``argv + libvirt's arguments`` from the next hook call."""
        if not argv or not os.path.isabs(argv[0]):
            raise ValueError("the hook command needs an absolute executable (libvirt's PATH)")
        for word in [*argv, *(env or {}).keys(), *(env or {}).values()]:
            if "\n" in word:
                raise ValueError(f"hook argv/env may not contain newlines: {word!r}")
        env_lines = [f"{k}={v}\n" for k, v in (env or {}).items()]
        self._write_atomic(self.hooks_dir / "qemu.env", "".join(env_lines))
        self._write_atomic(self.hooks_dir / "qemu.target", "".join(f"{w}\n" for w in argv))

    def remove_hook(self) -> None:
        """Back to a hook that accepts everything."""
        for name in ("qemu.target", "qemu.env"):
            (self.hooks_dir / name).unlink(missing_ok=True)

    # -- lifecycle ----------------------------------------------------------------------
    def prepare(self) -> None:
        """Create the private tree: dirs, config files and the trampoline hook."""
        for name in SYSTEM_DIRS:
            self.layout.private(name).mkdir(parents=True, exist_ok=True)
        self.hooks_dir.mkdir(exist_ok=True)
        for path, content in self.layout.config_files().items():
            path.write_text(content)
        hook = self.hooks_dir / "qemu"
        shutil.copyfile(TRAMPOLINE, hook)
        hook.chmod(0o755)
        for _source, target in self.layout.binds():
            # A bind needs its mount point; /run/libvirt is missing until libvirt first runs.
            Path(target).mkdir(parents=True, exist_ok=True)

    def start(self, warm_up: bool = True) -> None:
        """Start virtlogd then libvirtd; wait for their sockets (and the QEMU probe)."""
        if len(os.fsencode(self.layout.socket)) >= UNIX_PATH_MAX:
            raise ValueError(
                f"{self.layout.socket} is too long for a unix socket; use a shorter --basetemp"
            )
        self.prepare()
        t0 = time.monotonic()
        self._spawn("virtlogd", self.layout.config_dir / "virtlogd.conf")
        self._wait_socket("virtlogd", self.layout.virtlogd_socket)
        # libvirtd runs under a subreaper so that destroyed QEMUs are reaped at once.
        self._spawn(
            "libvirtd", self.layout.config_dir / "libvirtd.conf", [sys.executable, str(REAPER)]
        )
        self._wait_socket("libvirtd", self.layout.socket)
        self._libvirtd_pid = int((self.layout.run_dir / "libvirtd.pid").read_text().strip())
        self.timings["sockets_ready"] = time.monotonic() - t0
        if warm_up:
            # The first qemu driver call probes QEMU's capabilities (seconds); pay it here
            # once so that test timings show the tests, not the probe.
            t1 = time.monotonic()
            conn = self.connect()
            try:
                conn.getDomainCapabilities(None, "x86_64", None, "qemu", 0)
            finally:
                conn.close()
            self.timings["qemu_probe"] = time.monotonic() - t1
        self.timings["start_total"] = time.monotonic() - t0
        log.info("private libvirtd at %s ready: %s", self.uri, self.timings)

    def restart_libvirtd(self) -> float:
        """Stop libvirtd by its PID and start it again with the same config, as an operator's
        ``systemctl restart libvirtd`` does: running guests keep running (libvirtd leaves QEMU
        when it exits) and the new daemon reconnects to them, running the qemu hook's
        ``reconnect begin``. virtlogd stays. Returns the seconds until the new socket accepted.
        The QEMUs lose their subreaper with the old reaper and reparent to PID 1."""
        old = self._procs.get("libvirtd")
        if old is None or self._libvirtd_pid is None:
            raise RuntimeError("libvirtd is not running: start() it first")
        t0 = time.monotonic()
        stop_pid(self._libvirtd_pid)  # SIGTERM: a clean exit, guests left running
        stop_pid(old.pid, proc=old)  # its reaper exits with it; reap the reaper
        old.wait(timeout=STOP_TIMEOUT)
        pidfile = self.layout.run_dir / "libvirtd.pid"
        pidfile.unlink(missing_ok=True)  # never read the old daemon's pid for the new one
        self._libvirtd_pid = None
        self._spawn(
            "libvirtd", self.layout.config_dir / "libvirtd.conf", [sys.executable, str(REAPER)]
        )
        self._wait_socket("libvirtd", self.layout.socket)
        self._libvirtd_pid = int(pidfile.read_text().strip())
        self.timings["restart"] = time.monotonic() - t0
        return self.timings["restart"]

    def stop(self) -> list[int]:
        """Destroy running guests, stop libvirtd then virtlogd; return pids still alive."""
        qemu = self.qemu_pids()
        if self._libvirtd_pid is not None and pid_alive(self._libvirtd_pid):
            qemu.update(self._destroy_all_guests())
            stop_pid(self._libvirtd_pid)  # the reaper reaps it, then exits in turn
        for name in ("libvirtd", "virtlogd"):
            proc = self._procs.get(name)
            if proc is not None:
                stop_pid(proc.pid, proc=proc)
                proc.wait(timeout=STOP_TIMEOUT)
        for name, pid in qemu.items():
            # libvirtd leaves QEMU running when it exits: a guest we failed to destroy
            # must not outlive the test session.
            if pid_alive(pid) and _is_qemu(pid):
                log.warning("QEMU of %s (pid %d) outlived libvirtd, stopping it", name, pid)
                stop_pid(pid)
        survivors = [pid for pid in self.pids.values() if pid_alive(pid)]
        return survivors + [pid for pid in qemu.values() if pid_alive(pid) and _is_qemu(pid)]

    def _destroy_all_guests(self) -> dict[str, int]:
        pids = self.qemu_pids()
        conn = self.connect()
        try:
            for dom in conn.listAllDomains(1):  # VIR_CONNECT_LIST_DOMAINS_ACTIVE
                log.warning("guest %s still running at teardown, destroying it", dom.name())
                dom.destroy()
        finally:
            conn.close()
        return pids

    def _spawn(self, name: str, config: Path, wrapper: Sequence[str] = ()) -> None:
        out = (self.log_dir / f"{name}.out").open("ab")
        pidfile = self.layout.run_dir / f"{name}.pid"
        cmd = [*wrapper, _binary(name), "-f", str(config), "-p", str(pidfile)]
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LC_ALL": "C"}
        try:
            self._procs[name] = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_namespace_setup(self.layout.binds(self.cache_dir)),
            )
        except subprocess.SubprocessError as exc:
            raise RuntimeError(
                f"could not start {name} in a private mount namespace ({exc}); this needs root"
                " (CAP_SYS_ADMIN) and a kernel that allows unshare(CLONE_NEWNS)"
            ) from exc
        finally:
            out.close()

    def _wait_socket(self, name: str, path: Path) -> None:
        proc = self._procs[name]

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode} before its socket appeared; see "
                    f"{self.log_dir / (name + '.out')} and {self.log_dir / (name + '.log')}"
                )
            return socket_accepts(path)

        self.timings[f"{name}_socket"] = wait_for(ready, START_TIMEOUT, f"{name} socket {path}")

    @staticmethod
    def _write_atomic(path: Path, text: str) -> None:
        # A hook run reading half a file would run the wrong command.
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def _binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found is None:
        raise FileNotFoundError(f"{name} not found: install libvirt-daemon-system (make sysdeps)")
    return found


def _is_qemu(pid: int) -> bool:
    try:
        return b"qemu" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


# -- guests ---------------------------------------------------------------------------------
def guest_xml(name: str, guest_uuid: str, mdev_uuids: Sequence[str] = ()) -> str:
    """The test guest (tests/data/libvirtd/guest.xml) with a name, UUID and mdev hostdevs."""
    tree = etree.parse(str(GUEST_XML))
    root = tree.getroot()
    root.find("name").text = name
    uuid_el = etree.Element("uuid")
    uuid_el.text = guest_uuid
    root.find("name").addnext(uuid_el)
    devices = root.find("devices")
    for mdev in mdev_uuids:
        devices.append(mdev_hostdev(mdev))
    return etree.tostring(root, encoding="unicode")


def mdev_hostdev(mdev_uuid: str) -> etree._Element:
    """An mdev ``<hostdev>`` element for ``mdev_uuid`` (tests/data/libvirtd/mdev-hostdev.xml)."""
    element = etree.parse(str(MDEV_HOSTDEV_XML)).getroot()
    element.find("source/address").set("uuid", mdev_uuid)
    return element


def mdev_hostdev_xml(mdev_uuid: str) -> str:
    return etree.tostring(mdev_hostdev(mdev_uuid), encoding="unicode")


@dataclass(frozen=True)
class HookCall:
    """One recorded hook run."""

    argv: tuple[str, ...]
    name: str | None
    uuid: str | None
    mdevs: tuple[str, ...] | None  # mdev UUIDs in the XML the hook got; None if unreadable
    snapshot: str | None = None  # the recorder's snapshot file as the call found it

    @property
    def op(self) -> tuple[str, ...]:
        """(operation, sub-operation, extra): what the contract orders."""
        return self.argv[1:]


@dataclass
class HookRecorder:
    """The recording hook installed in a daemon, with its log."""

    daemon: LibvirtDaemon
    log_path: Path

    def install(self, fail: str = "", message: str = "", snapshot: Path | None = None) -> None:
        """(Re)install; ``fail`` = "operation" or "operation/sub-operation" to exit 1 on;
        ``snapshot``: a file each record keeps the text of as the call found it (the main
        hook runs before hooks/qemu.d, so it shows what those did up to the call before)."""
        env = {"RECORD_HOOK_LOG": str(self.log_path), "RECORD_HOOK_FAIL": fail}
        if message:
            env["RECORD_HOOK_MESSAGE"] = message
        if snapshot is not None:
            env["RECORD_HOOK_SNAPSHOT"] = str(snapshot)
        self.daemon.install_hook([sys.executable, str(RECORD_HOOK)], env)

    def calls(self, name: str | None = None) -> list[HookCall]:
        if not self.log_path.exists():
            return []
        records = [json.loads(line) for line in self.log_path.read_text().splitlines()]
        calls = [
            HookCall(
                tuple(r["argv"]),
                r["name"],
                r["uuid"],
                None if r["mdevs"] is None else tuple(r["mdevs"]),
                r.get("snapshot"),
            )
            for r in records
        ]
        return [c for c in calls if name is None or c.name == name]

    def ops(self, name: str) -> list[tuple[str, ...]]:
        return [c.op for c in self.calls(name)]


@dataclass
class GuestFactory:
    """Defines guests on a connection and removes them (and checks their QEMU) afterwards."""

    daemon: LibvirtDaemon
    conn: object
    names: list[str] = field(default_factory=list)
    qemu_seen: dict[str, int] = field(default_factory=dict)

    def define(self, mdev_uuids: Sequence[str] = (), prefix: str = "t"):
        guest_uuid = str(uuid.uuid4())
        name = f"{prefix}-{guest_uuid[:8]}"
        dom = self.conn.defineXML(guest_xml(name, guest_uuid, mdev_uuids))
        self.names.append(name)
        return dom

    def note_running(self) -> None:
        """Remember QEMU pids of running guests, to check at cleanup that they exited."""
        self.qemu_seen.update({n: p for n, p in self.daemon.qemu_pids().items() if n in self.names})

    def cleanup(self) -> list[int]:
        """Destroy + undefine every guest; return QEMU pids still alive afterwards."""
        import libvirt

        self.note_running()
        for name in self.names:
            try:
                dom = self.conn.lookupByName(name)
            except libvirt.libvirtError:
                continue
            if dom.isActive():
                dom.destroy()
            dom.undefine()
        return [pid for pid in self.qemu_seen.values() if pid_alive(pid) and _is_qemu(pid)]


def need_private_libvirtd() -> None:
    """What a private system-mode libvirtd needs here: root (a mount namespace, QEMU) and
    the daemon itself."""
    need(os.geteuid() == 0, "a private system-mode libvirtd needs root (mount namespace, QEMU)")
    found = shutil.which("libvirtd", path="/usr/sbin:/usr/bin") is not None
    need(found, "libvirtd is not installed (make sysdeps)")


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def libvirtd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LibvirtDaemon]:
    """One private virtlogd + libvirtd for the whole session; checks nothing outlives it."""
    need_private_libvirtd()
    daemon = LibvirtDaemon(tmp_path_factory.mktemp("libvirtd"))
    try:
        daemon.start()
        yield daemon
    finally:
        survivors = daemon.stop()
        assert not survivors, f"processes left running after libvirtd teardown: {survivors}"


@pytest.fixture
def libvirt_conn(libvirtd: LibvirtDaemon) -> Iterator[object]:
    conn = libvirtd.connect()
    yield conn
    conn.close()


@pytest.fixture
def hook_recorder(libvirtd: LibvirtDaemon, tmp_path: Path) -> Iterator[HookRecorder]:
    recorder = HookRecorder(libvirtd, tmp_path / "hook-calls.jsonl")
    recorder.install()
    yield recorder
    libvirtd.remove_hook()


@pytest.fixture
def libvirt_guests(libvirtd: LibvirtDaemon, libvirt_conn: object) -> Iterator[GuestFactory]:
    factory = GuestFactory(libvirtd, libvirt_conn)
    yield factory
    survivors = factory.cleanup()
    assert not survivors, f"QEMU processes left running after the test: {survivors}"


def host_supports_vfio() -> bool:
    """libvirt's own test (qemuHostdevHostSupportsPassthroughVFIO): IOMMU groups + the node."""
    groups = Path("/sys/kernel/iommu_groups")
    return groups.is_dir() and any(groups.iterdir()) and Path("/dev/vfio/vfio").exists()


# With VFIO present libvirt gets further and fails on the missing mdev instead.
needs_no_vfio = pytest.mark.skipif(host_supports_vfio(), reason="host has VFIO: other refusal")
