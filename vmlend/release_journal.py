"""Releases that could not reach the registry, kept on the host until they land.

A VM that stops while etcd is away (no quorum, cut off) still holds its devices in the
registry, and nobody would return them until someone ran ``vmlend reconcile --fix``. So the
release hook records what it could not return here, one file per VM under
``<root>/var/lib/vmlend/pending-releases/`` (the state directory survives a reboot, unlike
``/run``), written atomically; ``vmlend agent`` lands them (at start-up and after each good
renewal), and a new start of the same VM lands its own first, so a late retry can never return
devices the VM took again. Every change to the directory happens under one ``flock``.

An entry returns only what it names, and only what is still the stopped run's:

- each device with the fencing token its hold had when the release was recorded (the release
  reads the VM's holds before anything else), and the time it was recorded. Landing ends the
  hold only if it still carries that token; a release that could not read the token (the
  registry was away from its first call) ends only a hold made before it was recorded. Either
  way a newer hold of the same VM, or any hold of another VM, is never ended, and the VM's
  mdev on a device it took again is never removed (``lending.devices.return_pending``);
- only while the VM does not run here: the lander asks (``VmRuns``: the agent's hypervisor,
  ``running_here``), and a VM whose state nobody can tell waits;
- only entries of this node;
- entries an older vmlend wrote (devices as ``[fdid, mdev]`` pairs, no tokens, no times) are
  read as recorded at their ``since`` (to the second): their devices land like a release that
  could not read the token, and their shares by the mdevs the registry still records.

A start of the VM (its prepare hook) lands the VM's own entry first, under the same lock, and
takes over what could not land of the devices it takes again: they leave the entry, and the
new run's release returns them.

The agent runs as root and an entry makes it return devices, so the directory must be root's
(the process's own user), a real directory, writable by nobody else: otherwise nothing is read
from it or written to it, and the log (or the hook's one line) says why. Entries are read like
the agent's pause marks: regular files only, opened without following links and without
blocking (a FIFO there cannot hang the agent), at most ``MAX_ENTRY_BYTES``.
"""

from __future__ import annotations

import calendar
import contextlib
import fcntl
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from vmlend.domain.info import DomainXMLInfo
from vmlend.errors import (
    RegistryUnreachableError,
    ReleaseJournalError,
    ReleasePendingError,
    UnsafePathError,
    VmlendError,
)
from vmlend.fabric.base import Fabric
from vmlend.hostenv import HostEnv
from vmlend.registry.records import ExpectedHold, HoldRecord
from vmlend.safefile import NotAnEntry, own_directory, read_entry_at, replace_entry_at
from vmlend.topology.model import Holder, format_fdid

if TYPE_CHECKING:
    from vmlend.hypervisor.base import Hypervisor

log = logging.getLogger(__name__)

Record = Callable[[str], None]

#: Whether a VM runs on this host: True (running or paused: it has its devices), False (shut
#: off or not defined here), None (nobody can tell now: it waits).
VmRuns = Callable[[Holder], bool | None]

#: An entry lists one VM's devices: a few hundred bytes each. A larger file is not an entry.
MAX_ENTRY_BYTES = 256 * 1024
#: How long the agent waits for its hypervisor to say whether a VM runs (``running_here``).
RUNS_ANSWER_TIMEOUT = 1.0
#: The format entries are written in (1: an older vmlend's, without tokens and times).
ENTRY_VERSION = 2

_SINCE_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def _ignore(_msg: str) -> None:
    pass


class PendingDevice(msgspec.Struct, frozen=True):
    """A device whose release is pending: the mdev the VM's XML named, the fencing token of
    its hold when the release read it (0: not read), and when the release was recorded
    (seconds since the epoch)."""

    fdid: int
    mdev: str
    token: int = 0
    at: float = 0.0

    @property
    def expected(self) -> ExpectedHold:
        """The only hold landing this may end."""
        return ExpectedHold(self.token, self.at)


class PendingShare(msgspec.Struct, frozen=True):
    """A queue-level NVMe share whose release is pending: its drive (None: an older vmlend's
    entry did not keep it) and its mdev."""

    fdid: int | None
    mdev: str
    at: float = 0.0


class PendingRelease(msgspec.Struct):
    """What one stopped VM still has to give back."""

    node: str
    vm: str
    vm_uuid: str
    devices: list[PendingDevice] = msgspec.field(default_factory=list)
    shares: list[PendingShare] = msgspec.field(default_factory=list)
    since: str = ""
    why: str = ""
    version: int = ENTRY_VERSION

    @property
    def holder(self) -> Holder:
        return Holder(self.node, self.vm, self.vm_uuid)

    def names(self) -> str:
        """What it returns, for one line: ``0x10, 0x11, share of 0x30``."""
        out = [format_fdid(d.fdid) for d in self.devices]
        out += [
            f"share of {format_fdid(s.fdid)}" if s.fdid is not None else f"share mdev {s.mdev}"
            for s in self.shares
        ]
        return ", ".join(out) or "nothing"


class _Stored(msgspec.Struct):
    """An entry as stored: this version's, or an older vmlend's (``[fdid, mdev]`` pairs and
    share mdev UUIDs, no ``version``)."""

    node: str
    vm: str
    vm_uuid: str
    devices: list[PendingDevice | tuple[int, str]] = msgspec.field(default_factory=list)
    shares: list[PendingShare | str] = msgspec.field(default_factory=list)
    since: str = ""
    why: str = ""
    version: int = 1


def _since_epoch(since: str) -> float:
    """``since`` in seconds since the epoch (0 when it cannot be read: nothing predates it)."""
    try:
        return float(calendar.timegm(time.strptime(since, _SINCE_FORMAT)))
    except ValueError:
        return 0.0


def decode_entry(data: bytes) -> PendingRelease:
    """An entry of either format; ``msgspec.DecodeError`` when it is none. An older vmlend's
    devices and shares count as recorded at its ``since`` (to the second), without tokens."""
    raw = msgspec.json.decode(data, type=_Stored)
    at = _since_epoch(raw.since)
    devices = [
        d if isinstance(d, PendingDevice) else PendingDevice(int(d[0]), str(d[1]), 0, at)
        for d in raw.devices
    ]
    shares = [s if isinstance(s, PendingShare) else PendingShare(None, s, at) for s in raw.shares]
    return PendingRelease(
        raw.node, raw.vm, raw.vm_uuid, devices, shares, raw.since, raw.why, raw.version
    )


def merged(before: PendingRelease, new: PendingRelease) -> PendingRelease:
    """``before`` with what ``new`` (a later release of the same VM) adds: per device and per
    share the later record wins (its token and time are the newer run's). Pure."""
    devices = {d.fdid: d for d in before.devices}
    devices.update({d.fdid: d for d in new.devices})
    shares = {(s.fdid, s.mdev): s for s in before.shares}
    shares.update({(s.fdid, s.mdev): s for s in new.shares})
    return PendingRelease(
        new.node,
        new.vm,
        new.vm_uuid,
        [devices[f] for f in sorted(devices)],
        [shares[k] for k in sorted(shares, key=lambda k: (k[0] or -1, k[1]))],
        before.since or new.since,
        new.why or before.why,
    )


def _adds(before: PendingRelease, after: PendingRelease) -> bool:
    """Whether ``after`` names a device or share ``before`` does not (a re-run of the same
    release adds nothing: it is reported once)."""
    devices = {d.fdid for d in after.devices} - {d.fdid for d in before.devices}
    shares = {(s.fdid, s.mdev) for s in after.shares} - {(s.fdid, s.mdev) for s in before.shares}
    return bool(devices or shares)


def journal_dir(env: HostEnv | None = None) -> Path:
    return (env or HostEnv.from_env()).var / "lib" / "vmlend" / "pending-releases"


def entry_name(holder: Holder) -> str:
    """The entry file of ``holder``'s VM: its UUID (its name when it has none), made safe."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", holder.vm_uuid or holder.vm) + ".json"


class ReleaseJournal:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        #: Lines said once (an entry that waits says why once, not after every renewal).
        self._said: set[str] = set()

    @classmethod
    def for_host(cls, env: HostEnv | None = None) -> ReleaseJournal:
        return cls(journal_dir(env))

    # --- the directory -------------------------------------------------------------------
    @contextlib.contextmanager
    def _opened(self, create: bool) -> Iterator[int | None]:
        """The directory, locked, opened without following a link, if it is safe to use (None:
        it does not exist and ``create`` is false). ``UnsafePathError`` when it is not root's
        alone (the process's own user's); ``OSError`` when it cannot be made or locked."""
        with own_directory(self.dir, create=create) as fd:
            if fd is None:
                yield None
                return
            lock = os.open(
                ".lock",
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                0o600,
                dir_fd=fd,
            )
            try:
                if not stat.S_ISREG(os.fstat(lock).st_mode):
                    raise UnsafePathError(str(self.dir / ".lock"), "it is not a regular file")
                fcntl.flock(lock, fcntl.LOCK_EX)
                yield fd
            finally:
                os.close(lock)  # closing drops the lock

    def _entries(self, dfd: int, only: str | None = None) -> list[tuple[str, PendingRelease]]:
        """The entries in the directory (``only``: that file alone), by file name; anything
        that is not an entry is skipped, and said once."""
        names = [only] if only is not None else sorted(os.listdir(dfd))
        out = []
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            try:
                data = read_entry_at(dfd, name, MAX_ENTRY_BYTES)
            except NotAnEntry as e:
                self._once(f"not a pending release, left alone: {self.dir / name} ({e})", log.error)
                continue
            if data is None:
                continue
            try:
                out.append((name, decode_entry(data)))
            except msgspec.DecodeError as e:
                where = self.dir / name
                self._once(f"unreadable pending release {where} ({e}); not landed", log.error)
        return out

    def _once(self, line: str, say: Callable[[str], None] | None = None) -> bool:
        if line in self._said:
            return False
        self._said.add(line)
        if say is not None:
            say(line)
        return True

    # --- writing -------------------------------------------------------------------------
    def record(self, pending: PendingRelease) -> tuple[Path, bool]:
        """Keep ``pending`` (merged with what the VM already had pending) durably. The path,
        and whether that added anything (a release may run again: a re-run of the hook).
        ``ReleaseJournalError`` when the directory cannot be used: nothing is recorded."""
        name = entry_name(pending.holder)
        try:
            with self._opened(create=True) as dfd:
                assert dfd is not None
                before = next((p for _n, p in self._entries(dfd, only=name)), None)
                if before is not None:
                    if not _adds(before, pending) and before.version == ENTRY_VERSION:
                        return self.dir / name, False
                    pending = merged(before, pending)
                pending.since = pending.since or time.strftime(_SINCE_FORMAT, time.gmtime())
                replace_entry_at(dfd, name, msgspec.json.encode(pending))
        except (OSError, UnsafePathError) as e:
            why = e.why if isinstance(e, UnsafePathError) else (e.strerror or str(e))
            raise ReleaseJournalError(pending.vm, pending.names(), str(self.dir), why) from e
        return self.dir / name, True

    def pending(self) -> list[PendingRelease]:
        """Every entry (of any node), for reports and tests; none when the directory is not
        usable (logged)."""
        try:
            with self._opened(create=False) as dfd:
                return [] if dfd is None else [p for _n, p in self._entries(dfd)]
        except (OSError, UnsafePathError) as e:
            log.warning("cannot read the pending releases in %s: %s", self.dir, e)
            return []

    # --- landing -------------------------------------------------------------------------
    def settle(
        self,
        fabric: Fabric,
        *,
        runs: VmRuns,
        holder: Holder | None = None,
        record: Record = _ignore,
        taking: Collection[tuple[int, str]] = (),
    ) -> list[str]:
        """Land this node's pending releases (``holder``'s VM's only, when given) of VMs that
        ``runs`` says do not run here; what landed whole is removed, what is left is kept.
        ``taking``: ``(fdid, mdev)`` pairs the VM is about to take again (its prepare): left to
        that run, they leave the entry. One line per release landed, still failing, or
        waiting (a wait is said once); ``RegistryUnreachableError`` when the registry is still
        away (every entry stays as it was)."""
        lines: list[str] = []
        try:
            with self._opened(create=False) as dfd:
                if dfd is None:
                    return []
                only = entry_name(holder) if holder is not None else None
                for name, p in self._entries(dfd, only):
                    if p.node != fabric.local_node:
                        line = (
                            f"pending release of VM {p.vm!r} in {self.dir / name} is node"
                            f" {p.node!r}'s, not this node's ({fabric.local_node!r}); left alone"
                        )
                        if self._once(line):
                            lines.append(line)
                        continue
                    lines += self._settle_one(dfd, name, p, fabric, runs, record, taking)
        except (OSError, UnsafePathError) as e:
            line = f"pending releases in {self.dir} cannot be used: {e}"
            if self._once(line):
                lines.append(line)
        return lines

    def _settle_one(
        self,
        dfd: int,
        name: str,
        p: PendingRelease,
        fabric: Fabric,
        runs: VmRuns,
        record: Record,
        taking: Collection[tuple[int, str]],
    ) -> list[str]:
        state = runs(p.holder)
        if state is None or state:
            why = "it runs here" if state else "nobody can tell whether it runs here"
            line = f"pending release of VM {p.vm!r} ({p.names()}) waits: {why}"
            return [line] if self._once(line) else []
        left, failures, landed = land(fabric, p, record)
        left = _without(left, taking, record) if taking else left
        if not left.devices and not left.shares:
            os.unlink(name, dir_fd=dfd)
            if not landed:
                return []
            return [f"pending release of VM {p.vm!r} (since {p.since}) landed: {', '.join(landed)}"]
        if left != p:
            left.version = ENTRY_VERSION  # what is written is this version's format
            replace_entry_at(dfd, name, msgspec.json.encode(left))
        if not failures:
            return []
        done = f" (landed: {', '.join(landed)})" if landed else ""
        line = f"release of VM {p.vm!r} still incomplete{done}: {'; '.join(failures)}"
        return [line] if self._once(line) else []


def _without(
    p: PendingRelease, taking: Collection[tuple[int, str]], record: Record
) -> PendingRelease:
    """``p`` less what a new start of the VM takes again (by fdid or mdev): its run holds
    those now, and its release returns them."""
    fdids = {f for f, _m in taking}
    mdevs = {str(m) for _f, m in taking}
    keep = [d for d in p.devices if d.fdid not in fdids and d.mdev not in mdevs]
    shares = [s for s in p.shares if s.fdid not in fdids and s.mdev not in mdevs]
    if len(keep) != len(p.devices) or len(shares) != len(p.shares):
        given = PendingRelease(
            p.node,
            p.vm,
            p.vm_uuid,
            [d for d in p.devices if d not in keep],
            [s for s in p.shares if s not in shares],
        )
        record(f"pending release of {given.names()} left to this start (it takes them again)")
    return msgspec.structs.replace(p, devices=keep, shares=shares)


def land(
    fabric: Fabric, p: PendingRelease, record: Record = _ignore
) -> tuple[PendingRelease, list[str], list[str]]:
    """Return what ``p`` names (its VM known not to run here), and nothing else: what is left
    pending, the failures, and what landed. ``RegistryUnreachableError`` passes through."""
    from vmlend.lending.devices import return_pending
    from vmlend.lending.shares import return_pending_shares

    holder = p.holder
    landed: list[str] = []
    failures: list[str] = []
    shares: list[PendingShare] = []
    if p.shares:
        try:
            left, failed = return_pending_shares(
                fabric, holder, [(s.fdid, s.mdev) for s in p.shares], record
            )
        except RegistryUnreachableError:
            raise
        except VmlendError as e:
            left, failed = [(s.fdid, s.mdev) for s in p.shares], [str(e)]
        failures += failed
        waiting = {m for _f, m in left}
        shares = [s for s in p.shares if s.mdev in waiting]
        landed += [
            f"share of {format_fdid(s.fdid)}" if s.fdid is not None else f"share mdev {s.mdev}"
            for s in p.shares
            if s not in shares
        ]
    devices: list[PendingDevice] = []
    if p.devices:
        try:
            held: Mapping[int, HoldRecord] = fabric.holds_of(holder)
            records = fabric.mdev_records()
        except RegistryUnreachableError:
            raise
        except VmlendError as e:
            return msgspec.structs.replace(p, shares=shares), [*failures, str(e)], landed
        for d in p.devices:
            try:
                failure = return_pending(
                    fabric, holder, d.fdid, d.mdev, d.expected, held, records, record
                )
            except RegistryUnreachableError:
                raise
            except VmlendError as e:
                failure = str(e)
            if failure is None:
                landed.append(format_fdid(d.fdid))
            else:
                failures.append(failure)
                devices.append(d)
    return msgspec.structs.replace(p, devices=devices, shares=shares), failures, landed


def hold_tokens(fabric: Fabric, holder: Holder) -> dict[int, int]:
    """The fencing tokens of ``holder``'s holds, read before a release changes anything: what
    its entry records if the release cannot land (``RegistryUnreachableError`` passes)."""
    try:
        return {f: h.token for f, h in fabric.holds_of(holder).items()}
    except RegistryUnreachableError:
        raise
    except VmlendError as e:  # a damaged hold: the release judges it device by device
        log.warning("cannot read the holds of %s before its release: %s", holder, e)
        return {}


def pend_release(
    holder: Holder,
    devices: Sequence[tuple[int, object]],
    shares: Sequence[tuple[int, object]],
    why: RegistryUnreachableError,
    record: Record = _ignore,
    tokens: Mapping[int, int] | None = None,
) -> ReleasePendingError | None:
    """Record a release that could not reach the registry: the one-line error to report, or
    None when exactly that was pending already (reported by the run before).
    ``devices`` and ``shares``: ``(fdid, mdev)`` pairs; ``tokens``: the fencing tokens of the
    VM's holds, when the release read them (``hold_tokens``). ``ReleaseJournalError`` when it
    cannot be recorded: the devices stay held."""
    now = time.time()
    tokens = tokens or {}
    pending = PendingRelease(
        holder.node,
        holder.vm,
        holder.vm_uuid,
        [PendingDevice(f, str(m), tokens.get(f, 0), now) for f, m in devices],
        [PendingShare(f, str(m), now) for f, m in shares],
        why=str(why),
    )
    path, added = ReleaseJournal.for_host().record(pending)
    record(f"PENDING: {why}; recorded in {path}")
    if not added:
        return None
    return ReleasePendingError(
        holder.vm, f"the registry cannot be reached ({why.where})", str(path), pending.names()
    )


def pend_unopened(
    dom: DomainXMLInfo, node: str | None, why: RegistryUnreachableError, record: Record = _ignore
) -> ReleasePendingError | None:
    """``pend_release`` for a release hook that could not even open the fabric."""
    node = node or HostEnv.from_env().configured_node() or ""
    holder = Holder(node, dom.name, str(dom.uuid or ""))
    devices = [(d.fdid, d.mdev) for d in dom.devices if d.share is None]
    shares = [(d.fdid, d.mdev) for d in dom.devices if d.share is not None]
    return pend_release(holder, devices, shares, why, record)


def not_started(_holder: Holder) -> bool:
    """``VmRuns`` for a VM's own prepare hook: libvirt runs it before the VM's QEMU starts."""
    return False


def settle_own(
    fabric: Fabric,
    holder: Holder,
    record: Record = _ignore,
    taking: Collection[tuple[int, str]] = (),
) -> None:
    """Land a pending release of ``holder``'s VM before it takes devices again; what could not
    land of ``taking`` (what it takes again) is left to the new run."""
    journal = ReleaseJournal.for_host()
    for line in journal.settle(
        fabric, runs=not_started, holder=holder, record=record, taking=taking
    ):
        record(line)


#: The hypervisor asks of ``running_here`` still unanswered, by hypervisor and VM: a VM whose
#: last ask hangs is not asked again (no thread piles up behind a hung hypervisor).
_asking: set[tuple[int, str]] = set()
_asking_lock = threading.Lock()


def running_here(hv: Hypervisor | None, timeout: float = RUNS_ANSWER_TIMEOUT) -> VmRuns:
    """``VmRuns`` from this host's hypervisor (the agent's): a VM runs unless the hypervisor
    says it is shut off or not defined here. None (nobody can tell) when there is no
    hypervisor, when it fails, or when it does not answer within ``timeout``: it is asked on a
    thread of its own, so a hung hypervisor holds its caller up once per ``VmRuns``, for
    ``timeout``, and then not at all (later VMs are not asked), and a VM whose ask still
    hangs is not asked again."""
    hung = False

    def runs(holder: Holder) -> bool | None:
        nonlocal hung
        if hv is None or hung:
            return None
        key = (id(hv), holder.vm_uuid or holder.vm)
        with _asking_lock:
            if key in _asking:
                return None
            _asking.add(key)
        answer: list[bool | None] = []

        def ask() -> None:
            from vmlend.errors import UnknownDomainError
            from vmlend.hypervisor.base import DomainState

            try:
                info = hv.lookup(holder.vm_uuid or holder.vm)
            except UnknownDomainError:
                answer.append(False)
            except Exception as e:  # any failure means: nobody can tell now
                log.warning("cannot tell whether VM %s runs here: %s", holder.vm, e)
                answer.append(None)
            else:
                answer.append(info.state is not DomainState.SHUTOFF)
            finally:
                with _asking_lock:
                    _asking.discard(key)

        t = threading.Thread(target=ask, name=f"runs:{holder.vm}", daemon=True)
        t.start()
        t.join(timeout)
        if not answer:
            hung = True
            log.warning(
                "the hypervisor did not say within %.1f s whether VM %s runs", timeout, holder.vm
            )
            return None
        return answer[0]

    return runs
