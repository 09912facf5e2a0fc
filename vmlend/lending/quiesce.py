"""How each kind of device is stopped for a hot migration's switch-over, and which cannot be.

A hot migration keeps a remote device plugged while its VM moves (docs/migration.md). At the
switch-over, with the VM's vCPUs stopped so nothing new is submitted, the device must be
*quiesced*: what it has fetched completes (its DMA writes land and are logged dirty, its
completions are posted), nothing new is fetched, and its interrupts are held pending. Then no
TLP of it is in flight while its mappings move. This is the mdev's "stopped" migration state
(docs/smartio-contract.md): quiesced, mappings held.

What "fetched" and "complete" mean is the device kind's business, so the driver of each kind
says how it does it; a kind with no entry here has a driver that cannot (the contract's
refusal), and its devices fall back to unplug, migrate, plug back. Pure data: the CLI decides
from it before anything moves, the simulator's devices act it out.
"""

from __future__ import annotations

#: Device kind -> how its driver quiesces it. Kinds missing here cannot be quiesced.
QUIESCE: dict[str, str] = {
    "nvme": (
        "stops fetching submission queue entries; the commands it fetched complete and post"
        " their completion entries; admin commands wait"
    ),
    "gpu": (
        "stops the copy and compute engines at the next command boundary; the DMA they"
        " started completes; the channel state is saved in the device"
    ),
}


def how_to_quiesce(kind: str) -> str | None:
    """How a device of ``kind`` is quiesced; None when its driver cannot do it."""
    return QUIESCE.get(kind)


def cannot_quiesce(kinds: dict[int, str]) -> dict[int, str]:
    """The devices (fdid -> kind) of ``kinds`` whose drivers cannot be quiesced."""
    return {f: k for f, k in sorted(kinds.items()) if k not in QUIESCE}
