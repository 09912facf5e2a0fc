"""The manager of a shared NVMe drive (SmartIO's distributed NVMe driver, on the lender).

It owns the controller: resets and enables it, keeps the admin queues in its own memory,
allocates queue ids, vectors, LBA extents and address spaces to shares (``ShareBook``), gives
each share's queue ids their guard domain before anything is created on them, and creates and
deletes real I/O queues on a share's behalf at the addresses the guest chose (tagged with the
share's address space, so they resolve through that VM's DMA windows). Completion interrupts
are routed back to the share whose vector fired; page-mode guests' admin doorbell writes come
back from the drive as stray doorbells and are handed to the share's emulated admin queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import msgspec

from vmlend.errors import FabricError
from vmlend.nvme import spec
from vmlend.nvme.guard import QueueDomain
from vmlend.nvme.shares import Geometry, Share, ShareBook
from vmlend.sim.nvme.controller import NvmeController
from vmlend.sim.nvme.driver import NvmeDriver

log = logging.getLogger(__name__)

AdminDoorbell = Callable[[bool, int], None]
GuestInterrupt = Callable[[int], object]
PathInterrupt = Callable[[int, int], object]
T = TypeVar("T")  # (path, guest vector): a two-path share's relay


def _rekey(book: dict[str, T], old: str, new: str) -> None:
    if old in book:
        book[new] = book.pop(old)


class NvmeManager:
    """Manager of ``controller`` through ``driver`` (the lender's own NVMe driver)."""

    def __init__(
        self,
        controller: NvmeController,
        driver: NvmeDriver,
        name: str = "nvme",
        cmb_bytes: int = 0,
    ) -> None:
        """``cmb_bytes``: the controller memory buffer the manager keeps for its shares'
        submission queues (each share gets an extent of it)."""
        self.controller = controller
        self.driver = driver
        ns = controller.namespaces[1]
        cfg = controller.config
        self.book = ShareBook(
            Geometry(
                cfg.queue_pairs, cfg.dstrd, cfg.vectors, ns.blocks, name, cmb_bytes, cfg.entries
            )
        )
        self._lock = controller.lock
        self._admin_doorbells: dict[str, AdminDoorbell] = {}
        self._interrupts: dict[str, GuestInterrupt] = {}
        self._path_interrupts: dict[str, PathInterrupt] = {}
        self._queues: dict[str, set[tuple[str, int]]] = {}  # share -> {("sq"|"cq", real qid)}
        self._remove_stray = controller.on_stray_doorbell(self._stray)

    def start(self) -> None:
        """Reset and enable the controller, keep its admin queues, take every queue id."""
        with self._lock:
            self.driver.reset()
            self.driver.enable()
            self.driver.identify_controller()
            granted = self.driver.set_queue_count(self.controller.config.queue_pairs)
            if granted < self.controller.config.queue_pairs:
                raise FabricError(f"NVMe controller granted {granted} queue pairs only")

    def close(self) -> None:
        with self._lock:
            for name in list(self.book.shares):
                self.remove_share(name)
            self._remove_stray()

    # --- shares --------------------------------------------------------------------------------
    def add_share(
        self,
        name: str,
        queue_pairs: int,
        blocks: int,
        admin_doorbell: AdminDoorbell | None = None,
        interrupt: GuestInterrupt | None = None,
        decided: Share | None = None,
        paths: int = 1,
    ) -> Share:
        """Allocate a share (``ResourceExhaustedError`` when the drive has not enough left), or
        take the one the registry ``decided``, and guard its queue ids."""
        with self._lock:
            if decided is not None:
                share = self.book.adopt(decided)
            else:
                share = self.book.allocate(name, queue_pairs, blocks, paths)
            for g in range(1, share.queue_pairs + 1):
                for qid, asid in self._path_qids(share, g):
                    self.controller.set_domain(
                        qid,
                        QueueDomain(
                            share.name,
                            nsid=1,
                            offset=share.lba_offset,
                            length=share.blocks,
                            asid=asid,
                        ),
                    )
            name = share.name
            self._queues[name] = set()
            if admin_doorbell is not None:
                self._admin_doorbells[name] = admin_doorbell
            if interrupt is not None:
                self._interrupts[name] = interrupt
            log.info("NVMe share %s: %s", name, share.as_dict())
            return share

    @staticmethod
    def _path_qids(share: Share, g: int) -> list[tuple[int, int]]:
        """(real queue id, address space) of guest queue ``g`` on each of the share's paths."""
        out = [(share.real_qid(g), share.asid)]
        if share.paths > 1:
            out.append((share.backup_qid(g), share.backup_asid))
        return out

    def connect(
        self,
        name: str,
        admin_doorbell: AdminDoorbell,
        interrupt: GuestInterrupt,
        path_interrupt: PathInterrupt | None = None,
    ) -> None:
        with self._lock:
            self._admin_doorbells[name] = admin_doorbell
            self._interrupts[name] = interrupt
            if path_interrupt is not None:
                self._path_interrupts[name] = path_interrupt

    def remove_share(self, name: str) -> None:
        """Delete the share's real queues (others' queues are untouched) and free it."""
        with self._lock:
            self.delete_queues(name)
            self.forget_share(name)

    def delete_queues(self, name: str) -> None:
        """Delete the share's real queues; the share (its queue ids, blocks, address space)
        stays allocated and guarded."""
        with self._lock:
            share = self.book.shares.get(name)
            if share is None:
                return
            for path in range(share.paths):
                for g in range(1, share.queue_pairs + 1):
                    self.delete_sq(share, g, path)
                for g in range(1, share.queue_pairs + 1):
                    self.delete_cq(share, g, path)

    def disconnect(self, name: str) -> None:
        """Its virtual controller went (hot-unplugged): no admin doorbell or interrupt of the
        share is routed until ``connect`` again."""
        with self._lock:
            self._admin_doorbells.pop(name, None)
            self._interrupts.pop(name, None)
            self._path_interrupts.pop(name, None)

    def rename_share(self, old: str, new: str) -> Share:
        """Share ``old`` is called ``new`` from now on (its VM moved hot to another node: the
        share's name follows its node); its queues, vectors, blocks and routes stay."""
        with self._lock:
            share = self.book.shares.pop(old, None)
            if share is None:
                raise FabricError(f"NVMe share {old} does not exist on this drive")
            if new in self.book.shares:
                self.book.shares[old] = share
                raise FabricError(f"NVMe share {new} exists already on this drive")
            moved = msgspec.structs.replace(share, name=new)
            self.book.shares[new] = moved
            self.controller.rename_owner(old, new)
            _rekey(self._queues, old, new)
            _rekey(self._admin_doorbells, old, new)
            _rekey(self._interrupts, old, new)
            _rekey(self._path_interrupts, old, new)
            return moved

    def forget_share(self, name: str) -> None:
        """Drop the share without asking the controller (it is being reset, or cannot answer):
        the guard, the queue book and the interrupt and admin-doorbell routes forget it; its
        queues go with the next controller reset."""
        with self._lock:
            share = self.book.shares.get(name)
            if share is not None:
                for g in range(1, share.queue_pairs + 1):
                    for qid, _asid in self._path_qids(share, g):
                        self.controller.clear_domain(qid)
                self.book.release(name)
            self._queues.pop(name, None)
            self._admin_doorbells.pop(name, None)
            self._interrupts.pop(name, None)
            self._path_interrupts.pop(name, None)

    def detach(self) -> None:
        """The manager lost the drive (its borrow ended): forget every share, stop listening
        for stray doorbells. The controller is reset by whoever takes the drive next."""
        with self._lock:
            for name in set(self.book.shares) | set(self._interrupts):
                self.forget_share(name)
            self._remove_stray()

    def wiring(self) -> list[tuple[str, str, str]]:
        """``(share, kind, detail)`` for each path the manager keeps for a share: its real
        queues, its interrupt route and its admin doorbell route."""
        with self._lock:
            out = [
                (name, "queue", f"{kind} {qid}")
                for name, queues in self._queues.items()
                for kind, qid in sorted(queues)
            ]
            out += [(name, "interrupt-route", "vectors") for name in self._interrupts]
            out += [(name, "admin-doorbell", "route") for name in self._admin_doorbells]
            return out

    def shares(self) -> list[Share]:
        return list(self.book.shares.values())

    def real_queues(self, name: str) -> list[int]:
        """Real SQ ids the share has now."""
        return sorted(q for kind, q in self._queues.get(name, set()) if kind == "sq")

    # --- queue commands forwarded from a virtual controller --------------------------------
    def _admin(self, cmd: spec.Command, what: str) -> int:
        return self.driver.admin_command(cmd, what, check=False).status

    @staticmethod
    def _real(share: Share, qid: int, path: int) -> int:
        return share.backup_qid(qid) if path else share.real_qid(qid)

    def create_cq(
        self, share: Share, qid: int, gpa: int, entries: int, vector: int, irq: bool, path: int = 0
    ) -> int:
        """Create real CQ of guest queue ``qid`` on path ``path`` (1: the backup pair) at
        ``gpa`` in that path's address space."""
        with self._lock:
            real = self._real(share, qid, path)
            flags = spec.QUEUE_PHYS_CONTIG | (spec.CQ_IRQ_ENABLED if irq else 0)
            rv = share.backup_vector(vector) if path else share.real_vector(vector)
            status = self._admin(
                spec.Command(
                    spec.ADMIN_CREATE_CQ,
                    prp1=gpa,
                    cdw10=(entries - 1) << 16 | real,
                    cdw11=flags | rv << 16,
                ),
                f"create CQ {real} for {share.name}",
            )
            if status == spec.SC_SUCCESS:
                self._queues[share.name].add(("cq", real))
            return status

    def create_sq(
        self, share: Share, qid: int, gpa: int, entries: int, cqid: int, path: int = 0
    ) -> int:
        with self._lock:
            real = self._real(share, qid, path)
            status = self._admin(
                spec.Command(
                    spec.ADMIN_CREATE_SQ,
                    prp1=gpa,
                    cdw10=(entries - 1) << 16 | real,
                    cdw11=spec.QUEUE_PHYS_CONTIG | self._real(share, cqid, path) << 16,
                ),
                f"create SQ {real} for {share.name}",
            )
            if status == spec.SC_SUCCESS:
                self._queues[share.name].add(("sq", real))
            return status

    def _delete(self, share: Share, qid: int, kind: str, opcode: int, path: int = 0) -> int:
        with self._lock:
            real = self._real(share, qid, path)
            if (kind, real) not in self._queues.get(share.name, set()):
                return spec.SC_INVALID_QID
            status = self._admin(spec.Command(opcode, cdw10=real), f"delete {kind} {real}")
            if status == spec.SC_SUCCESS:
                self._queues[share.name].discard((kind, real))
            return status

    def delete_sq(self, share: Share, qid: int, path: int = 0) -> int:
        return self._delete(share, qid, "sq", spec.ADMIN_DELETE_SQ, path)

    def delete_cq(self, share: Share, qid: int, path: int = 0) -> int:
        return self._delete(share, qid, "cq", spec.ADMIN_DELETE_CQ, path)

    # --- routing ----------------------------------------------------------------------------
    def route_interrupt(self, vector: int) -> None:
        """The drive raised ``vector``: signal the share that owns it (vector 0 is ours)."""
        if vector == 0:
            return
        share = self.book.by_real_vector(vector)
        if share is None:
            log.debug("NVMe vector %d has no share", vector)
            return
        relay = self._path_interrupts.get(share.name)
        guest_vector = share.guest_vector(vector)
        if relay is not None:  # a two-path share: its relay takes both pairs' completions
            backup = share.backup_guest_vector(vector)
            relay(0 if guest_vector is not None else 1, guest_vector or backup or 0)
            return
        sink = self._interrupts.get(share.name)
        if sink is None or guest_vector is None:
            log.debug("NVMe vector %d has no share", vector)
            return
        sink(guest_vector)

    def _stray(self, qid: int, completion: bool, value: int) -> None:
        share = self.book.by_admin_slot(qid)
        handler = self._admin_doorbells.get(share.name) if share else None
        if handler is None:
            log.debug("stray doorbell write to queue %d ignored", qid)
            return
        handler(completion, value)

    def rejections(self, name: str) -> int:
        return self.controller.stats.rejections.get(name, 0)
