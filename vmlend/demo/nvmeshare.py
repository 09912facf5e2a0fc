"""Step 9 of the story: two VMs on different hosts share the NVMe drive at the queue level,
and the guard rejects a command that reaches outside one VM's blocks (docs/nvme-sharing.md).

The drive is shared through the registry (the manager's hold, a share per VM claimed at
reserve), then driven in the simulated hardware by each guest's own NVMe driver. Everything is
returned at the end, so the story can be told again.
"""

from __future__ import annotations

from vmlend.demo.context import Json, Story, require
from vmlend.ledger import nvmeshares as ledger
from vmlend.nvme import spec
from vmlend.sim.nvme.driver import BumpAllocator, NvmeDriver
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.topology.model import GuestRam, GuestRange, Holder, MiB, format_fdid
from vmlend.views.table import render_table

NAMESPACE_BLOCKS = 1 << 21  # 1 GiB of 512-byte blocks
SHARE_BLOCKS = 1 << 16  # 32 MiB each
GUEST_RAM = 64 * MiB
VMS = (("gamma", "nvme-a"), ("beta", "nvme-b"))


def nvme_share_step(s: Story) -> Json:
    cfg = s.config
    reg, hw = s.c.registry, s.c.hw
    fdid = cfg.nvme
    geometry = drive_geometry(s.c.fabric(cfg.borrower).topology().device(fdid), NAMESPACE_BLOCKS)
    ledger.lend_shared(reg, fdid, geometry)
    holders = [Holder(node, vm) for node, vm in VMS]
    drive: SharedNvmeDrive | None = None
    try:
        ram = GuestRam((GuestRange(0, GUEST_RAM),))
        # each share claims its DMA windows' room on the lender's adapter, as a device would
        shares = [
            ledger.reserve_share(reg, fdid, h, 1, SHARE_BLOCKS, guest_ram=ram) for h in holders
        ]
        backing = s.state_path.parent / "nvme"  # the namespace's sparse file
        backing.mkdir(exist_ok=True)
        # the cluster's interrupt targets: a share's MSI lands on the same page per VM
        drive = SharedNvmeDrive(
            hw, fdid, backing, blocks=NAMESPACE_BLOCKS, msi_targets=s.c.msi_targets
        )
        vms, drivers = [], []
        for (node, vm), share, h in zip(VMS, shares, holders, strict=True):
            guest = hw.create_guest(node, vm, [GuestRange(0, GUEST_RAM)])
            with reg.read() as tx:  # its completion interrupts cross the NTB if admitted
                windows = ledger.interrupt_windows(tx, fdid, h)
            vms.append(drive.open_share(node, vm, share=share, interrupts=windows))
            vms[-1].set_master()  # the guest's driver enables its controller: windows mapped
            want = "ntb" if windows else "relay"
            require(vms[-1].interrupt_path() == want, f"{vm}'s interrupts are not on the {want}")
            drivers.append(NvmeDriver(vms[-1].bar0, guest, BumpAllocator(16 * MiB, 32 * MiB)))
        queues = [d.start(queues=1)[0] for d in drivers]
        seen = [d.identify_namespace(1) for d in drivers]
        io = []
        for (node, vm), d, qp in zip(VMS, drivers, queues, strict=True):
            data = f"block 0 of {vm} on {node}".encode().ljust(4096, b".")
            wrote = d.write(qp, 0, data)
            done, back = d.read(qp, 0, 8)
            require(wrote.ok and done.ok and back == data, f"{vm} did not read back its write")
            io.append({"vm": f"{node}/{vm}", "wrote": 8, "read_back": True})
        # VM A names the first block past its window: B's first block
        stray = drivers[0].write(queues[0], SHARE_BLOCKS, b"X" * 512)
        require(stray.status == spec.SC_LBA_OUT_OF_RANGE, "the guard let a stray command through")
        b_data = drivers[1].read(queues[1], 0, 1)[1]
        require(b_data.startswith(b"block 0 of nvme-b"), "VM B's block changed")
        # while both share the drive, every mapping is justified by a share of the right VM
        # and the shares' windows take exactly the segments they claimed
        found = s.c.violations()
        require(not found, f"fabric invariant violated while sharing: {found[0] if found else ''}")
        drive.record(reg)
        status = [e.to_json() for e in ledger.shared_drives(reg)[fdid][2]]
        traps = sum(v.traps for v in vms)
        result: Json = {
            "fdid": format_fdid(fdid),
            "doorbells": drive.mode,
            "namespace": [list(x) for x in seen],
            "io": io,
            "stray": {
                "from": f"{VMS[0][0]}/{VMS[0][1]}",
                "lba": SHARE_BLOCKS,
                "status": spec.status_name(stray.status),
                "neighbour_untouched": True,
            },
            "shares": status,
            "doorbell_traps": traps,
            "invariant_violations": len(found),
        }
        for v in vms:
            v.close()
        for node, vm in VMS:
            hw.destroy_guest(node, vm)
    finally:
        if drive is not None:
            drive.close()
        for h in holders:
            ledger.release_share(reg, fdid, h)
        ledger.unshare(reg, fdid)
    require(hw.borrowed(fdid) is None, f"{format_fdid(fdid)} is still taken after sharing")
    return result


def render_nvme_share(d: Json) -> str:
    rows = [
        [
            f"{s['node']}/{s['vm']}",
            s["queue_pairs"],
            f"{s['lba_offset']}+{s['blocks']}",
            ",".join(map(str, s["real_queues"])),
            s["guard_rejections"],
        ]
        for s in d["shares"]
    ]
    stray = d["stray"]
    return "\n\n".join(
        [
            f"{d['fdid']} shared by {len(rows)} VMs ({d['doorbells']} doorbells); each guest's "
            "driver sees one namespace of its share and reads back its own writes",
            render_table(("VM", "QUEUE PAIRS", "LBA WINDOW", "REAL QIDS", "REJECTED"), rows),
            f"{stray['from']} wrote LBA {stray['lba']} (outside its window): {stray['status']};"
            " the other VM's block is unchanged",
        ]
    )
