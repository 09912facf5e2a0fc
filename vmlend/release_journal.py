"""Releases that could not reach the registry, kept on the host until they land.

A VM that stops while etcd is away (no quorum, cut off) still holds its devices in the
registry, and nobody would return them until someone ran ``vmlend reconcile --fix``. So the
release hook records what it could not return here, one file per VM under
``<root>/var/lib/vmlend/pending-releases/`` (the state directory survives a reboot, unlike
``/run``), written atomically; ``vmlend agent`` lands them (at start-up and after each good
renewal), and a new start of the same VM lands its own first, so a late retry can never return
devices the VM took again. Every change to the directory happens under one ``flock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgspec

from vmlend.domain.info import DomainXMLInfo
from vmlend.errors import RegistryUnreachableError, ReleasePendingError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hostenv import HostEnv
from vmlend.topology.model import Holder, format_fdid

log = logging.getLogger(__name__)

Record = Callable[[str], None]


def _ignore(_msg: str) -> None:
    pass


class PendingRelease(msgspec.Struct):
    """What one stopped VM still has to give back: ``devices`` as ``(fdid, mdev)`` pairs and
    the mdevs of its queue-level NVMe shares."""

    node: str
    vm: str
    vm_uuid: str
    devices: list[tuple[int, str]] = msgspec.field(default_factory=list)
    shares: list[str] = msgspec.field(default_factory=list)
    since: str = ""
    why: str = ""

    @property
    def holder(self) -> Holder:
        return Holder(self.node, self.vm, self.vm_uuid)


def journal_dir(env: HostEnv | None = None) -> Path:
    return (env or HostEnv.from_env()).var / "lib" / "vmlend" / "pending-releases"


class ReleaseJournal:
    def __init__(self, directory: Path) -> None:
        self.dir = directory

    @classmethod
    def for_host(cls, env: HostEnv | None = None) -> ReleaseJournal:
        return cls(journal_dir(env))

    def _path(self, holder: Holder) -> Path:
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", holder.vm_uuid or holder.vm)
        return self.dir / f"{name}.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def record(self, pending: PendingRelease) -> tuple[Path, bool]:
        """Keep ``pending`` (merged with what the VM already had pending) durably. The path,
        and whether that added anything (a release may run again: a re-run of the hook)."""
        with self._locked():
            path = self._path(pending.holder)
            before = self._load(path)
            if before is not None:
                had = [(int(f), str(m)) for f, m in before.devices]
                devices = sorted(set(had) | {(int(f), str(m)) for f, m in pending.devices})
                shares = sorted(set(before.shares) | set(pending.shares))
                if devices == sorted(had) and shares == sorted(before.shares):
                    return path, False
                pending.devices = devices
                pending.shares = shares
                pending.since = before.since
            pending.since = pending.since or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                f.write(msgspec.json.encode(pending))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)  # the rename itself survives a crash
            finally:
                os.close(dfd)
            return path, True

    def pending(self) -> list[PendingRelease]:
        if not self.dir.is_dir():
            return []
        out = []
        for path in sorted(self.dir.glob("*.json")):
            p = self._load(path)
            if p is not None:
                out.append(p)
        return out

    @staticmethod
    def _load(path: Path) -> PendingRelease | None:
        try:
            return msgspec.json.decode(path.read_bytes(), type=PendingRelease)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError, json.JSONDecodeError) as e:
            log.error("unreadable pending release %s (%s); left for the operator", path, e)
            return None

    def settle(
        self, fabric: Fabric, holder: Holder | None = None, record: Record = _ignore
    ) -> list[str]:
        """Land the pending releases (of ``holder``'s VM only, when given): each landed one is
        removed. One line per release landed or still failing; ``RegistryUnreachableError``
        still unreachable (the rest stays pending)."""
        if not self.dir.is_dir():
            return []
        lines = []
        with self._locked():
            paths = [self._path(holder)] if holder is not None else sorted(self.dir.glob("*.json"))
            for path in paths:
                p = self._load(path)
                if p is None or p.node != fabric.local_node:
                    continue
                failures = land(fabric, p, record)
                if failures:
                    lines.append(f"release of VM {p.vm!r} still incomplete: {'; '.join(failures)}")
                    continue
                path.unlink()
                fds = ", ".join(format_fdid(f) for f, _m in p.devices) or "no device"
                lines.append(f"pending release of VM {p.vm!r} (since {p.since}) landed: {fds}")
        return lines


def land(fabric: Fabric, p: PendingRelease, record: Record = _ignore) -> list[str]:
    """Return what ``p`` names, as the release hook would have; the failures."""
    from vmlend.lending.devices import return_all
    from vmlend.lending.shares import return_shares

    try:
        failures = return_shares(fabric, p.holder, p.shares, record)
        failures += return_all(fabric, p.holder, p.devices, record)
    except RegistryUnreachableError:
        raise
    except VmlendError as e:
        failures = [str(e)]
    return failures


def pend_release(
    holder: Holder,
    devices: Sequence[tuple[int, object]],
    shares: Sequence[object],
    why: RegistryUnreachableError,
    record: Record = _ignore,
) -> ReleasePendingError | None:
    """Record a release that could not reach the registry: the one-line error to report, or
    None when exactly that was pending already (reported by the run before)."""
    pending = PendingRelease(
        holder.node,
        holder.vm,
        holder.vm_uuid,
        [(f, str(m)) for f, m in devices],
        [str(m) for m in shares],
        why=str(why),
    )
    path, added = ReleaseJournal.for_host().record(pending)
    record(f"PENDING: {why}; recorded in {path}")
    if not added:
        return None
    return ReleasePendingError(
        holder.vm, f"the registry cannot be reached ({why.where})", str(path)
    )


def pend_unopened(
    dom: DomainXMLInfo, node: str | None, why: RegistryUnreachableError, record: Record = _ignore
) -> ReleasePendingError | None:
    """``pend_release`` for a release hook that could not even open the fabric."""
    node = node or HostEnv.from_env().configured_node() or ""
    holder = Holder(node, dom.name, str(dom.uuid or ""))
    devices = [(d.fdid, d.mdev) for d in dom.devices if d.share is None]
    shares = [d.mdev for d in dom.devices if d.share is not None]
    return pend_release(holder, devices, shares, why, record)


def settle_own(fabric: Fabric, holder: Holder, record: Record = _ignore) -> None:
    """Land a pending release of ``holder``'s VM before it takes devices again."""
    for line in ReleaseJournal.for_host().settle(fabric, holder, record):
        record(line)
