"""What a detach would change, computed without changing anything (``detach --dry-run``)."""

from __future__ import annotations

import msgspec

from vmlend.domain import DomainDocument, find_device, remove_device
from vmlend.hypervisor import Hypervisor
from vmlend.ops.definitions import read_targets, resolve_targets


class DetachPreview(msgspec.Struct):
    name: str
    fdid: int
    targets: tuple[str, ...]
    before: dict[str, bytes]
    after: dict[str, bytes]

    @property
    def pending(self) -> tuple[str, ...]:
        """Targets that have the device (the ones a detach would change)."""
        return tuple(t for t in self.targets if self.after[t] != self.before[t])


def preview_detach(
    hv: Hypervisor, vm: str, fdid: int, *, live: bool, config: bool
) -> DetachPreview:
    info = hv.lookup(vm)
    targets = resolve_targets(info, live, config)
    before = read_targets(hv, info.name, targets)
    after: dict[str, bytes] = {}
    for t, xml in before.items():
        doc = DomainDocument.parse(xml, source=f"{t} XML of {info.name}")
        after[t] = remove_device(doc, fdid).to_bytes() if find_device(doc, fdid) else xml
    return DetachPreview(info.name, fdid, targets, before, after)
