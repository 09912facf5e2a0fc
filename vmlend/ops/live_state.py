"""What a live migration keeps on disk: the journal of one in progress, and each VM's history.

Unplugged (``mode`` "unplug"), a live migration takes the VM's remote devices out of the
running guest before it moves and puts them back at the same guest addresses on the
destination. Between the two, the devices are in no domain XML at all, so what must come back
(and when each went) is written down first, in
``<state dir>/live-migrations/<vm digest>.pending.json``: a re-run after ``kill -9`` reads it
and finishes. The file goes once every device is back. Hot (``mode`` "hot"), the devices stay
in the guest and the journal keeps the room claimed for them on the destination
(``claimed``), which the re-run releases or finishes.

Each finished live migration appends one record to ``<vm digest>.history.json`` (the last
``HISTORY_KEPT``): per device its blackout (unplugged: from the start of its unplug on the
source to the end of its hot-plug on the destination; hot: from its quiesce at the switch-over
to the guest running on the destination) and the VM's downtime (its vCPUs stopped for the
switch-over, as the hypervisor measured it). ``vmlend status`` shows them.
"""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from vmlend import safefile
from vmlend.domain import NvmeShareRequest, PciAddress
from vmlend.errors import StateError
from vmlend.ledger.handover import Claimed
from vmlend.topology.model import InterruptPath, format_fdid

T = TypeVar("T")

#: Records kept per VM.
HISTORY_KEPT = 20


class LiveDevice(msgspec.Struct, frozen=True):
    """A remote device to bring back: where the guest had it, and its own interrupt path."""

    fdid: int
    address: PciAddress | None = None
    interrupts: InterruptPath | None = None
    #: A queue-level NVMe share of drive ``fdid`` (not the whole drive): its request, for its
    #: controller's plug back (unplugged moves: the share itself moves, keeping its blocks).
    share: NvmeShareRequest | None = None


class LiveJournal(msgspec.Struct):
    """A live migration in progress."""

    vm: str
    vm_uuid: str
    source: str
    destination: str
    devices: list[LiveDevice]
    #: The fencing token of the VM's hold on each device when the migration began (by fdid;
    #: none in a journal an older vmlend wrote): the registry's record of the migration
    #: (``vmlend.ops.migration_record``) carries them, and so does each plug request.
    tokens: dict[int, int] = msgspec.field(default_factory=dict)
    #: The VM's vmlend metadata without its devices (libvirt's plain form): put back on the
    #: live XML before the move when unplugging emptied it, so that the destination's hook
    #: still sees a vmlend VM and rewrites it for its host. None: the VM had none.
    shell: bytes | None = None
    #: ``time.monotonic()`` when each device's unplug (hot: its quiesce) began (by fdid; same
    #: machine, so one clock across the processes of an interrupted and a resumed run).
    unplugged: dict[int, float] = msgspec.field(default_factory=dict)
    #: When each came back into the guest on the destination (hot: the guest ran there with
    #: it), monotonic, by fdid.
    back: dict[int, float] = msgspec.field(default_factory=dict)
    #: When the VM ran on the destination (monotonic), and the downtime the hypervisor measured.
    migrated: float | None = None
    downtime: float | None = None
    resumed: bool = False
    #: "unplug" (unplug, migrate, plug back) or "hot" (the devices stay plugged).
    mode: str = "unplug"
    #: Hot: the room claimed on the destination beside the source's (None: not yet).
    claimed: Claimed | None = None
    #: The drives of ``devices`` the VM has a queue-level NVMe share of (not a hold).
    shares: list[int] = msgspec.field(default_factory=list)
    #: Mixed ("mixed"): the devices that go unplugged (they cannot quiesce); the rest move hot.
    unplug: list[int] = msgspec.field(default_factory=list)
    #: ``--rollback`` began handing the holds back (written before the hand-back commits):
    #: a re-run that finds them the source's again re-points the lenders, which the killed
    #: run may not have done.
    handing_back: bool = False

    def device_mode(self, fdid: int) -> str:
        """How device ``fdid`` moves: "hot" or "unplug"."""
        if self.mode == "mixed":
            return "unplug" if fdid in self.unplug else "hot"
        return self.mode


class LiveRecord(msgspec.Struct, frozen=True):
    """One finished live migration of a VM."""

    source: str
    destination: str
    finished: float  # time.time()
    downtime: float | None
    #: Seconds each device was out of the guest (by fdid); None: it did not come back.
    blackout: dict[int, float | None]
    resumed: bool = False
    mode: str = "unplug"
    #: How each device moved (by fdid): "hot" or "unplug" (empty in older records: ``mode``).
    modes: dict[int, str] = msgspec.field(default_factory=dict)

    def device_mode(self, fdid: int) -> str:
        return self.modes.get(fdid, self.mode)

    def to_json(self) -> dict[str, Any]:
        return {
            "from": self.source,
            "to": self.destination,
            "mode": self.mode,
            "modes": {format_fdid(f): self.device_mode(f) for f in sorted(self.blackout)},
            "finished": self.finished,
            "downtime": self.downtime,
            "blackout": {format_fdid(f): s for f, s in sorted(self.blackout.items())},
            "resumed": self.resumed,
        }


class _History(msgspec.Struct):
    vm: str
    records: list[LiveRecord] = msgspec.field(default_factory=list)


def _path(state_dir: Path, vm: str, kind: str) -> Path:
    digest = hashlib.sha256(vm.encode()).hexdigest()[:16]
    return state_dir / "live-migrations" / f"{digest}.{kind}.json"


def _read(path: Path) -> bytes | None:
    try:
        return safefile.read_regular(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateError(f"cannot read {path}: {e.strerror}; check its permissions") from None


def _write(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        safefile.write_atomically(path, data, mode=0o600)
    except OSError as e:
        raise StateError(
            f"cannot write {path}: {e.strerror}; free space or fix permissions, then re-run"
        ) from None


def _decode(data: bytes, kind: type[T], path: Path) -> T:
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.DecodeError as e:
        raise StateError(
            f"{path} is damaged ({e}); look at it, then remove it to forget what it records"
        ) from None


def load_journal(state_dir: Path, vm: str) -> LiveJournal | None:
    """The journal of ``vm``'s live migration in progress, if any."""
    path = _path(state_dir, vm, "pending")
    data = _read(path)
    if data is None:
        return None
    journal = _decode(data, LiveJournal, path)
    return journal if journal.vm == vm else None  # a digest clash is no journal of this VM


def save_journal(state_dir: Path, journal: LiveJournal) -> None:
    _write(_path(state_dir, journal.vm, "pending"), msgspec.json.encode(journal))


def drop_journal(state_dir: Path, vm: str) -> None:
    try:
        _path(state_dir, vm, "pending").unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise StateError(f"cannot remove the live-migration journal of {vm!r}: {e}") from None


def history(state_dir: Path, vm: str) -> list[LiveRecord]:
    """``vm``'s finished live migrations, oldest first."""
    path = _path(state_dir, vm, "history")
    data = _read(path)
    if data is None:
        return []
    found = _decode(data, _History, path)
    return found.records if found.vm == vm else []


def record(state_dir: Path, vm: str, rec: LiveRecord) -> None:
    """Append ``rec`` to ``vm``'s history (the last ``HISTORY_KEPT`` are kept)."""
    records = [*history(state_dir, vm), rec][-HISTORY_KEPT:]
    _write(_path(state_dir, vm, "history"), msgspec.json.encode(_History(vm, records)))
