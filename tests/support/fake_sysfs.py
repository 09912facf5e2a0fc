"""A fake host root for tests: a sysfs tree in a temp dir plus the kernel's write semantics.

Reads need no emulation: the tree holds ordinary files and relative symlinks laid out as the
kernel lays them out, so ``vmlend.kernel.mdev`` reads it exactly as it reads ``/sys``. Writes
that the
kernel turns into actions (``create``, ``remove``, the SmartIO ``borrow``/``unborrow``...) cannot
be plain files, so ``FakeSysfs`` *is* the ``SysfsWriter`` handed to the code under test: it
applies what the kernel would do (make the device directory and its links, count instances, emit
uevents) or raises ``OSError`` with the kernel's errno. A write to any other sysfs attribute fails
with ``EIO``, as for an attribute without a store handler; outside sysfs it lands in the file.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import fake_dmawin, fake_nvmeshare
from vmlend.hostenv import HostEnv
from vmlend.kernel.udev import Uevent
from vmlend.topology.model import Topology

_KERNEL_UUID = re.compile(r"^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}\n?$")


def _oserror(code: int, path: Path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _link(link: Path, target: Path) -> None:
    """A relative symlink, as sysfs makes them, so the tree can sit under any root."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


@dataclass
class FakeType:
    type_id: str
    name: str = ""
    description: str = ""
    device_api: str = "vfio-pci"
    available: int = 1
    weight: int = 1  # instances of a shared parent pool one child takes (mtty: ports)
    probe_errno: int = 0  # the vendor driver's create fails with this errno


@dataclass
class _Parent:
    name: str
    path: Path  # the device directory under sys/devices
    types: dict[str, FakeType]
    pool: int | None = None  # shared capacity across types (mtty), None = per-type counts


@dataclass
class _Child:
    uuid: str
    parent: str
    type_id: str
    path: Path


@dataclass
class FakeSysfs:
    """The fake host below ``root``. Use ``env`` for the code under test and the fake itself
    as its ``SysfsWriter``."""

    root: Path
    events: list[Uevent] = field(default_factory=list)
    listeners: list[Callable[[Uevent], None]] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)  # children whose remove returns EBUSY
    handlers: dict[Path, Callable[[str], None]] = field(default_factory=dict)
    #: Called with each new child (a vendor driver's probe adding the child's own attributes).
    child_hooks: list[Callable[[_Child], None]] = field(default_factory=list)
    #: Called with each child about to go (the vendor driver's remove callback).
    child_gone_hooks: list[Callable[[_Child], None]] = field(default_factory=list)
    _parents: dict[str, _Parent] = field(default_factory=dict)
    _children: dict[str, _Child] = field(default_factory=dict)
    _next_group: int = 100

    def __post_init__(self) -> None:
        self.env = HostEnv(self.root)
        for d in (self.env.mdev_bus, self.env.mdev_devices, self.env.iommu_groups):
            d.mkdir(parents=True, exist_ok=True)

    # --- building the tree --------------------------------------------------------------------
    def add_parent(
        self,
        name: str,
        types: list[FakeType],
        device_dir: str = "devices/pci0000:00",
        pool: int | None = None,
        announce: bool = True,
    ) -> Path:
        """Register ``name`` as an mdev parent (what ``mdev_register_parent`` does)."""
        path = self.root / "sys" / device_dir / name
        path.mkdir(parents=True, exist_ok=True)
        types = [dataclasses.replace(t) for t in types]  # the fake counts in its own copies
        parent = _Parent(name, path, {t.type_id: t for t in types}, pool)
        self._parents[name] = parent
        for t in types:
            d = path / "mdev_supported_types" / t.type_id
            (d / "devices").mkdir(parents=True, exist_ok=True)
            if t.name:
                (d / "name").write_text(t.name + "\n")
            if t.description:
                (d / "description").write_text(t.description + "\n")
            (d / "device_api").write_text(t.device_api + "\n")
            (d / "create").write_text("")  # write-only in the kernel; present for open()
        self._write_available(parent)
        _link(self.env.mdev_bus / name, path)
        if announce:
            self.emit(Uevent("change", name, "pci", {"MDEV_STATE": "registered"}))
        return path

    def add_mtty(self, ports: int = 24) -> Path:
        """The kernel's mtty sample: one pool of serial ports shared by a 1- and a 2-port type."""
        return self.add_parent(
            "mtty",
            [
                FakeType("mtty-1", "Single port serial", device_api="vfio-pci", weight=1),
                FakeType("mtty-2", "Dual port serial", device_api="vfio-pci", weight=2),
            ],
            device_dir="devices/virtual/mtty",
            pool=ports,
        )

    def remove_parent(self, name: str, announce: bool = True) -> None:
        """Unregister ``name``: like the kernel, its children go first."""
        parent = self._parents[name]
        for child in [c for c in self._children.values() if c.parent == name]:
            self._destroy(child)
        del self._parents[name]
        (self.env.mdev_bus / name).unlink()
        shutil.rmtree(parent.path / "mdev_supported_types")
        if announce:
            self.emit(Uevent("change", name, "pci", {"MDEV_STATE": "unregistered"}))

    def set_available(self, parent: str, type_id: str, count: int) -> None:
        p = self._parents[parent]
        p.types[type_id].available = count
        self._write_available(p)

    def _write_available(self, p: _Parent) -> None:
        for t in p.types.values():
            count = t.available if p.pool is None else p.pool // t.weight
            (p.path / "mdev_supported_types" / t.type_id / "available_instances").write_text(
                f"{count}\n"
            )

    def emit(self, ev: Uevent) -> None:
        self.events.append(ev)
        for listener in self.listeners:
            listener(ev)

    # --- the SysfsWriter: the kernel's store handlers -----------------------------------------
    def write(self, path: Path, text: str) -> None:
        if not path.exists():
            raise _oserror(errno.ENOENT, path)
        real = path.resolve()
        handler = self.handlers.get(real)
        if handler is not None:
            handler(text)
            return
        if real.name == "create" and real.parent.parent.name == "mdev_supported_types":
            self._store_create(real.parent.parent.parent.name, real.parent.name, text, path)
        elif real.name == "remove" and any(c.path == real.parent for c in self._children.values()):
            self._store_remove(real.parent.name, text, path)
        elif real.is_relative_to(self.env.sys.resolve()):
            # A sysfs attribute without a store handler: even root's write fails.
            raise _oserror(errno.EIO, path)
        else:
            real.write_text(text)

    def _store_create(self, parent_name: str, type_id: str, text: str, path: Path) -> None:
        parent = self._parents.get(parent_name)
        if parent is None:
            raise _oserror(errno.ENODEV, path)
        if not _KERNEL_UUID.match(text):
            raise _oserror(errno.EINVAL, path)
        uuid = text.strip().lower()
        if uuid in self._children:
            raise _oserror(errno.EEXIST, path)
        t = parent.types[type_id]
        left = t.available if parent.pool is None else parent.pool // t.weight
        if left <= 0:
            # The core's own count says EUSERS; a driver counting a shared pool says ENOSPC.
            raise _oserror(errno.EUSERS if parent.pool is None else errno.ENOSPC, path)
        if t.probe_errno:
            raise _oserror(t.probe_errno, path)
        if parent.pool is None:
            t.available -= 1
        else:
            parent.pool -= t.weight
        self._write_available(parent)
        dev = parent.path / uuid
        dev.mkdir()
        type_dir = parent.path / "mdev_supported_types" / type_id
        _link(dev / "mdev_type", type_dir)
        group = self.env.iommu_groups / str(self._next_group)
        self._next_group += 1
        (group / "devices").mkdir(parents=True)
        _link(group / "devices" / uuid, dev)
        _link(dev / "iommu_group", group)
        (dev / "remove").write_text("")
        _link(self.env.mdev_devices / uuid, dev)
        _link(type_dir / "devices" / uuid, dev)
        child = self._children[uuid] = _Child(uuid, parent_name, type_id, dev)
        for hook in self.child_hooks:
            hook(child)
        self.emit(Uevent("add", uuid, "mdev", {"MDEV_TYPE": type_id}))

    def _store_remove(self, uuid: str, text: str, path: Path) -> None:
        try:
            value = int(text.strip(), 0)
        except ValueError:
            raise _oserror(errno.EINVAL, path) from None
        if not value:
            return
        if uuid in self.busy:
            raise _oserror(errno.EBUSY, path)
        self._destroy(self._children[uuid])

    def _destroy(self, child: _Child) -> None:
        for hook in self.child_gone_hooks:
            hook(child)
        parent = self._parents[child.parent]
        if parent.pool is None:
            parent.types[child.type_id].available += 1
        else:
            parent.pool += parent.types[child.type_id].weight
        group = (child.path / "iommu_group").resolve()
        shutil.rmtree(group)
        (self.env.mdev_devices / child.uuid).unlink()
        (parent.path / "mdev_supported_types" / child.type_id / "devices" / child.uuid).unlink()
        for f in list(self.handlers):
            if f.is_relative_to(child.path):  # the child's attributes go with it
                del self.handlers[f]
        shutil.rmtree(child.path)
        del self._children[child.uuid]
        self._write_available(parent)
        self.emit(Uevent("remove", child.uuid, "mdev"))


class RacingWriter:
    """Wraps a writer and runs ``before`` just before the next write: a race in slow motion
    (e.g. the parent vanishing between listing and creating)."""

    def __init__(self, inner: FakeSysfs, before: Callable[[], None]) -> None:
        self.inner = inner
        self.before: Callable[[], None] | None = before

    def write(self, path: Path, text: str) -> None:
        if self.before is not None:
            before, self.before = self.before, None
            before()
        self.inner.write(path, text)


class Crash(BaseException):
    """The process dies here, as with kill -9: no handler of vmlend's runs after it."""


class CrashOnCreate:
    """A writer whose process dies (``Crash``) just before it writes an mdev's ``create``."""

    def __init__(self, inner: FakeSysfs) -> None:
        self.inner = inner

    def write(self, path: Path, text: str) -> None:
        if path.name == "create":
            raise Crash(path)
        self.inner.write(path, text)


class PipeUeventSource:
    """A uevent source on a real pipe: ``send`` writes one JSON line, ``receive`` reads without
    blocking, so the watcher's ``select`` loop runs for real."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._buf = b""

    def fileno(self) -> int:
        return self._r

    def send(self, ev: Uevent) -> None:
        line = json.dumps(
            {"a": ev.action, "n": ev.sys_name, "s": ev.subsystem, "p": dict(ev.properties)}
        )
        os.write(self._w, line.encode() + b"\n")

    def receive(self) -> Uevent | None:
        if b"\n" not in self._buf:
            try:
                self._buf += os.read(self._r, 65536)
            except BlockingIOError:
                return None
        if b"\n" not in self._buf:
            return None
        line, self._buf = self._buf.split(b"\n", 1)
        d = json.loads(line)
        return Uevent(d["a"], d["n"], d["s"], d["p"])

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


@dataclass
class _FakeDev:
    fdid: int
    lender_node_id: int
    attrs: dict[str, str]
    availability: str = "available"
    borrower: int = -1
    wants_parent: bool = False  # registered by 'borrow', kept across an unreachable lender
    token: int = 0  # the largest fencing token written to 'token'
    tokens: list[int] = field(default_factory=list)  # every token accepted, in order
    spent: int = 0  # the newest token spent (taken back for, or its hold released)


class FakeSmartio:
    """The SmartIO driver of docs/smartio-contract.md, on top of a ``FakeSysfs``."""

    def __init__(self, fake: FakeSysfs, node_id: int) -> None:
        self.fake = fake
        self.node_id = node_id
        self.base = fake.env.smartio
        self.base.mkdir(parents=True, exist_ok=True)
        (self.base / "node_id").write_text(f"{node_id}\n")
        self.devs: dict[int, _FakeDev] = {}
        for attr, fn in (
            ("lend", self._lend),
            ("unlend", self._unlend),
            ("borrow", self._borrow),
            ("unborrow", self._unborrow),
        ):
            path = self.base / attr
            path.write_text("")
            fake.handlers[path.resolve()] = self._parsing(attr, fn)
        take_back = self.base / "take_back"
        take_back.write_text("")
        fake.handlers[take_back.resolve()] = self._take_back
        #: fdids the driver took back (unmapped and reset), in order.
        self.taken_back: list[int] = []
        #: What each parent this driver registers offers besides one ``smartio-lend`` child
        #: (docs/smartio-contract.md): tests set more, for children vmlend did not make
        #: (another share's, or made by hand as ``mdevctl`` would) beside its own.
        self.lend_instances = 1
        self.extra_types: list[FakeType] = []
        #: Whether ``smartio-lend`` children get section 8's ``smartio/`` group (False: a
        #: driver from before it); the segment size its ``dma_windows`` checks against (None:
        #: not checked) and numbers ``dma_state``'s segments by.
        self.data_path = True
        self.segment_size: int | None = None
        #: Per child: the windows it accepted (None: none written), and every write's text.
        self.windows: dict[str, fake_dmawin.Accepted | None] = {}
        self.window_writes: dict[str, list[str]] = {}
        #: Section 7's shares: per shareable fdid the controller's (queue pairs, vectors)
        #: (``share_drive``); whether share children get their ``smartio/`` files (False: a
        #: driver that offers shares but predates them); per drive the shares its manager
        #: runs, by child UUID; every write to a child's ``nvme_share``, by child.
        self.shareable: dict[int, tuple[int, int]] = {}
        self.share_files = True
        self.runs: dict[int, dict[str, fake_nvmeshare.Run]] = {}
        self.share_writes: dict[str, list[str]] = {}
        fake.child_hooks.append(self._child_added)
        fake.child_gone_hooks.append(self._child_gone)

    def _name(self, fdid: int) -> str:
        return f"smartio-{fdid:x}"

    def _dir(self, fdid: int) -> Path:
        return self.fake.root / "sys" / "devices" / "virtual" / "smartio" / self._name(fdid)

    def add_device(
        self,
        fdid: int,
        lender_node_id: int,
        bdf: str = "0000:41:00.0",
        vendor: int = 0x8086,
        device: int = 0x0A54,
        class_code: int = 0x010802,
        dma_bits: int = 64,
        bars: str = "0 0x4000 mem64\n",
        physfn: int | None = None,
        availability: str = "available",
        adapter: int = 0,
    ) -> None:
        d = self._dir(fdid)
        d.mkdir(parents=True)
        attrs = {
            "fdid": f"{fdid:#x}",
            "lender_node_id": str(lender_node_id),
            "lender_adapter": str(adapter),
            "lender_bdf": bdf,
            "vendor": f"{vendor:#06x}",
            "device": f"{device:#06x}",
            "class": f"{class_code:#08x}",
            "dma_bits": str(dma_bits),
            "physfn": "" if physfn is None else f"{physfn:#x}",
        }
        for k, v in attrs.items():
            (d / k).write_text(v + "\n")
        (d / "bars").write_text(bars)
        (d / "token").write_text("0\n")
        self.fake.handlers[(d / "token").resolve()] = lambda text, f=fdid: self._token(f, text)
        (d / "spent").write_text("0\n")
        self.fake.handlers[(d / "spent").resolve()] = lambda text, f=fdid: self._spend(f, text)
        self.devs[fdid] = _FakeDev(fdid, lender_node_id, attrs, availability)
        self._sync(fdid)
        _link(self.base / self._name(fdid), d)
        self.fake.emit(Uevent("add", self._name(fdid), "smartio"))

    def add_adapter(
        self,
        index: int,
        model: str = "PXH830",
        window_size: int = 128 << 30,
        segments: int = 32,
        lut_entries: int = 32,
        link: str = "up",
        peer: tuple[int, int] | None = None,
        switch_port: int | None = None,
    ) -> Path:
        """One of this host's NTB adapters (docs/smartio-contract.md, section 1), with what its
        cable leads to: a peer adapter ``(node id, index)``, a switch port, or neither. Returns
        its directory, whose files a test may damage."""
        d = self.fake.root / "sys" / "devices" / "virtual" / "smartio" / f"adapter{index}"
        d.mkdir(parents=True)
        attrs = {
            "index": str(index),
            "model": model,
            "window_size": f"{window_size:#x}",
            "segments": str(segments),
            "lut_entries": str(lut_entries),
            "link": link,
            "peer": "" if peer is None else f"{peer[0]} {peer[1]}",
            "switch_port": "" if switch_port is None else str(switch_port),
        }
        for k, v in attrs.items():
            (d / k).write_text(v + "\n")
        _link(self.base / f"adapter{index}", d)
        return d

    def _sync(self, fdid: int) -> None:
        dev, d = self.devs[fdid], self._dir(fdid)
        (d / "availability").write_text(dev.availability + "\n")
        (d / "borrower_node_id").write_text(f"{dev.borrower}\n")

    def _parsing(self, attr: str, fn: Callable[[int], None]) -> Callable[[str], None]:
        def store(text: str) -> None:
            try:
                fdid = int(text.strip(), 0)
            except ValueError:
                raise _oserror(errno.EINVAL, self.base / attr) from None
            if fdid not in self.devs:
                raise _oserror(errno.ENODEV, self.base / attr)
            fn(fdid)

        return store

    # --- the store handlers -------------------------------------------------------------------
    def _lend(self, fdid: int) -> None:
        dev = self.devs[fdid]
        if dev.lender_node_id != self.node_id:
            raise _oserror(errno.EREMOTE, self.base / "lend")
        if dev.availability == "unlent":
            self.set_availability(fdid, "available")

    def _unlend(self, fdid: int) -> None:
        dev = self.devs[fdid]
        if dev.lender_node_id != self.node_id:
            raise _oserror(errno.EREMOTE, self.base / "unlend")
        if dev.borrower >= 0:
            raise _oserror(errno.EBUSY, self.base / "unlend")
        self.set_availability(fdid, "unlent")

    def _borrow(self, fdid: int) -> None:
        dev = self.devs[fdid]
        if dev.availability == "unlent":
            raise _oserror(errno.EPERM, self.base / "borrow")
        if dev.availability == "unreachable":
            raise _oserror(errno.EHOSTUNREACH, self.base / "borrow")
        dev.wants_parent = True
        if self._name(fdid) not in self.fake._parents:
            self._register(fdid)

    def _take_back(self, text: str) -> None:
        """'FDID TOKEN': end any borrow of the device, unmap and reset it; ``ESTALE`` for a
        token older than the device's (a newer holder has it)."""
        path = self.base / "take_back"
        try:
            fdid_text, token_text = text.split()
            fdid, token = int(fdid_text, 0), int(token_text)
        except ValueError:
            raise _oserror(errno.EINVAL, path) from None
        if fdid not in self.devs:
            raise _oserror(errno.ENODEV, path)
        dev = self.devs[fdid]
        if token < dev.token:
            raise _oserror(errno.ESTALE, path)
        dev.borrower = -1
        dev.token = token
        self._spent(fdid, token)
        self._sync(fdid)
        self.taken_back.append(fdid)

    def _token(self, fdid: int, text: str) -> None:
        """The fencing token of the hold the next step is for: an older one is ``ESTALE``."""
        dev, path = self.devs[fdid], self._dir(fdid) / "token"
        try:
            token = int(text.strip())
        except ValueError:
            raise _oserror(errno.EINVAL, path) from None
        if token < dev.token or token <= dev.spent:
            raise _oserror(errno.ESTALE, path)
        dev.token = token
        dev.tokens.append(token)
        path.write_text(f"{token}\n")

    def _spend(self, fdid: int, text: str) -> None:
        """A hold's release: its token is spent, served yet or not; never ``ESTALE``."""
        try:
            token = int(text.strip())
        except ValueError:
            raise _oserror(errno.EINVAL, self._dir(fdid) / "spent") from None
        self._spent(fdid, token)

    def _spent(self, fdid: int, token: int) -> None:
        dev = self.devs[fdid]
        dev.spent = max(dev.spent, token)
        (self._dir(fdid) / "spent").write_text(f"{dev.spent}\n")

    def _unborrow(self, fdid: int) -> None:
        dev, name = self.devs[fdid], self._name(fdid)
        if any(c.parent == name for c in self.fake._children.values()):
            raise _oserror(errno.EBUSY, self.base / "unborrow")
        dev.wants_parent = False
        if name in self.fake._parents:
            self.fake.remove_parent(name)

    def _register(self, fdid: int) -> None:
        lend = FakeType(
            "smartio-lend", "SmartIO lent device", f"fdid {fdid:#x}", available=self.lend_instances
        )
        share = []
        if fdid in self.shareable and not any(
            t.type_id == "smartio-nvme_share" for t in self.extra_types
        ):
            share = [FakeType("smartio-nvme_share", "SmartIO NVMe share", available=64)]
        self.fake.add_parent(
            self._name(fdid),
            [lend, *share, *self.extra_types],
            device_dir="devices/virtual/smartio",
        )

    # --- queue-level NVMe shares (section 7) -------------------------------------------------
    def share_drive(self, fdid: int, queue_pairs: int = 511, vectors: int = 32) -> None:
        """The driver can run the manager for ``fdid`` (its ``nvme_share`` says so); parents
        registered from now on offer ``smartio-nvme_share``."""
        d = self._dir(fdid)
        self.shareable[fdid] = (queue_pairs, vectors)
        (d / "nvme_share").write_text(f"supported {queue_pairs} {vectors} 0\n")
        self.runs.setdefault(fdid, {})
        self._list_runs(fdid)

    def _list_runs(self, fdid: int) -> None:
        lines = [r.listed(u) + "\n" for u, r in sorted(self.runs[fdid].items())]
        (self._dir(fdid) / "nvme_shares").write_text("".join(lines))

    def _share_child(self, child: _Child) -> int | None:
        fdid = next((f for f in self.devs if self._name(f) == child.parent), None)
        if fdid is None or child.type_id != "smartio-nvme_share":
            return None
        return fdid

    def _nvme_share(self, fdid: int, uuid: str, text: str) -> None:
        path = self._group(uuid) / "nvme_share"
        self.share_writes[uuid].append(text)
        runs = self.runs[fdid]
        try:
            epoch, run = fake_nvmeshare.parse(text)
            mine = runs.get(uuid)
            if mine is not None and epoch < mine.epoch:
                raise fake_dmawin.Refused(errno.ESTALE, "an older epoch")
            if run is not None:
                qp, vectors = self.shareable[fdid]
                fake_nvmeshare.check(run, uuid, runs, qp, vectors)
        except fake_dmawin.Refused as e:
            raise _oserror(e.code, path) from None
        if run is None:
            runs.pop(uuid, None)  # its queues deleted, guard and MSI unprogrammed
            path.write_text(f"epoch {epoch}\n")
            (self._group(uuid) / "nvme_share_state").write_text("none\n")
        else:
            runs[uuid] = run
            path.write_text("\n".join([f"epoch {epoch}", *run.lines()]) + "\n")
            state = ["active", f"epoch {epoch}", *run.lines(), "msi 0 -"]
            (self._group(uuid) / "nvme_share_state").write_text("\n".join(state) + "\n")
        self._list_runs(fdid)

    def _child_gone(self, child: _Child) -> None:
        fdid = self._share_child(child)
        if fdid is not None and self.runs[fdid].pop(child.uuid, None) is not None:
            self._list_runs(fdid)  # the driver ends a removed child's share itself

    def unload(self) -> None:
        """The driver goes (``rmmod``): its parents and their children, then its class."""
        for fdid in self.devs:
            if self._name(fdid) in self.fake._parents:
                self.fake.remove_parent(self._name(fdid))
        for f in list(self.fake.handlers):
            if f.is_relative_to(self.base.resolve()) or "smartio" in f.parts:
                del self.fake.handlers[f]
        shutil.rmtree(self.fake.root / "sys" / "devices" / "virtual" / "smartio")
        shutil.rmtree(self.base)

    # --- the child's data path (section 8) ---------------------------------------------------
    def _child_added(self, child: _Child) -> None:
        share = self._share_child(child)
        if share is not None and self.share_files:
            group = child.path / "smartio"
            group.mkdir()
            (group / "nvme_share").write_text("")
            (group / "nvme_share_state").write_text("none\n")
            self.share_writes[child.uuid] = []
            self.fake.handlers[(group / "nvme_share").resolve()] = (
                lambda text, f=share, u=child.uuid: self._nvme_share(f, u, text)
            )
            return
        fdid = next((f for f in self.devs if self._name(f) == child.parent), None)
        if fdid is None or child.type_id != "smartio-lend" or not self.data_path:
            return
        group = child.path / "smartio"
        group.mkdir()
        (group / "dma_windows").write_text("")
        (group / "dma_state").write_text("none\n")
        self.windows[child.uuid] = None
        self.window_writes[child.uuid] = []
        self.fake.handlers[(group / "dma_windows").resolve()] = (
            lambda text, f=fdid, u=child.uuid: self._dma_windows(f, u, text)
        )

    def _group(self, uuid: str) -> Path:
        return self.fake.env.mdev_devices / uuid / "smartio"

    def _dma_windows(self, fdid: int, uuid: str, text: str) -> None:
        dev, path = self.devs[fdid], self._group(uuid) / "dma_windows"
        self.window_writes[uuid].append(text)
        try:
            accepted = fake_dmawin.check(
                text, dev.token, dev.spent, int(dev.attrs["dma_bits"]), self.segment_size
            )
        except fake_dmawin.Refused as e:
            raise _oserror(e.code, path) from None
        mapped = not self.dma_state(uuid).startswith(("none", "refused"))
        if mapped and accepted != self.windows[uuid]:
            raise _oserror(errno.EBUSY, path)
        self.windows[uuid] = accepted
        path.write_text(accepted.text())

    def dma_state(self, uuid: str) -> str:
        return (self._group(uuid) / "dma_state").read_text()

    def set_dma_state(self, uuid: str, text: str) -> None:
        """What the driver reports, as a test wants it (a refusal, a partial unmap)."""
        (self._group(uuid) / "dma_state").write_text(text)

    def bus_master(self, uuid: str, on: bool = True) -> None:
        """The guest sets (or clears) Bus Master through the child: the fake maps every
        written range (it pins nothing), or refuses with ``ENODATA`` when none are written."""
        fdid = next(f for f in self.devs if self._name(f) == self.fake._children[uuid].parent)
        adapter = int(self.devs[fdid].attrs["lender_adapter"])
        text = fake_dmawin.state_text(self.windows[uuid], adapter, self.segment_size or 4 << 30)
        was = self.dma_state(uuid).split(maxsplit=1)[0]
        self.set_dma_state(uuid, text if on else "none\n")
        self.dma_event(uuid, fdid, was)

    def dma_event(self, uuid: str, fdid: int, was: str) -> None:
        """The driver's ``SMARTIO_DMA`` change uevent on the child, sent when ``dma_state``'s
        first word is no longer ``was`` (section 8, "The guest event")."""
        word = self.dma_state(uuid).split(maxsplit=1)[0]
        if word != was:
            props = {"SMARTIO_FDID": f"{fdid:#x}", "SMARTIO_DMA": word}
            self.fake.emit(Uevent("change", uuid, "mdev", props))

    # --- what happens elsewhere in the fabric -------------------------------------------------
    def set_availability(self, fdid: int, availability: str) -> None:
        """The lender lends/withdraws, or its link goes down/up. An unreachable lender takes
        the parent (and its children) away; its return brings the parent back."""
        dev, name = self.devs[fdid], self._name(fdid)
        dev.availability = availability
        if availability != "available":
            dev.borrower = -1
        self._sync(fdid)
        self.fake.emit(Uevent("change", name, "smartio", {"SMARTIO_AVAILABILITY": availability}))
        registered = name in self.fake._parents
        if availability == "unreachable" and registered:
            self.fake.remove_parent(name)
        elif availability == "available" and dev.wants_parent and not registered:
            self._register(fdid)

    def guest_enable(self, fdid: int) -> None:
        """The guest enabled the device: the driver takes the hardware borrow for this node."""
        self.devs[fdid].borrower = self.node_id
        self._sync(fdid)

    def guest_release(self, fdid: int) -> None:
        self.devs[fdid].borrower = -1
        self._sync(fdid)


def populate_smartio(smartio: FakeSmartio, topology: Topology) -> None:
    """Every device of ``topology`` as the SmartIO driver would list it."""
    ids = {n.name: n.node_id for n in topology.nodes}
    for d in topology.devices:
        bars = "".join(
            f"{b.index} {b.size:#x} {b.kind.value}{' prefetch' if b.prefetch else ''}\n"
            for b in d.bars
        )
        smartio.add_device(
            d.fdid,
            ids[d.lender],
            bdf=d.bdf,
            vendor=d.vendor_id,
            device=d.device_id,
            class_code=d.class_code,
            dma_bits=d.dma_bits,
            bars=bars,
            physfn=d.physfn,
            availability="available" if d.lent else "unlent",
        )
