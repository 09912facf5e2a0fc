"""Decide from argv and the raw stdin bytes whether a hook call can concern vmlend at all.

libvirt runs the hook for every domain on every operation and waits for it. Most calls are
for operations vmlend ignores or for domains without vmlend metadata; those must cost no more
than an interpreter start, so this module imports nothing (no enum or dataclasses either: the
contract's types are built from the table here, not the other way round). A false positive
only costs the full parse; a false negative cannot happen for the XML libvirt writes: it
formats the document itself, in UTF-8, with every namespace URI spelled out in an ``xmlns``
attribute.
"""

from __future__ import annotations

#: (operation, sub-operation) -> what vmlend does; anything else is ignored.
#: ``vmlend.hook.contract.Action`` is built from these values.
OPERATIONS: dict[tuple[str, str], str] = {
    ("prepare", "begin"): "prepare",
    # The VM's mdevs go and its devices are returned at release, libvirt's last call, never at
    # "stopped end": after that call libvirt still restores the VM's security labels (for an
    # mdev through its iommu_group) and lets go of its hostdevs, and an mdev removed under it
    # made it log an error at every stop. libvirt runs release after a failed start too.
    ("release", "end"): "release",
    ("reconnect", "begin"): "reconnect",
    ("migrate", "begin"): "migrate",
    ("restore", "begin"): "restore",
}

#: Any version of vmlend's metadata namespace (``vmlend.domain.metadata.NAMESPACE_URI``):
#: a newer version must still reach the full parse, which refuses it instead of ignoring it.
NAMESPACE_FAMILY = b"http://vmlend.org/xmlns/domain/"


def mentions_vmlend(xml: bytes) -> bool:
    """Whether the domain XML may carry vmlend metadata."""
    return NAMESPACE_FAMILY in xml


def concerns_vmlend(argv: list[str], xml: bytes) -> bool:
    """Whether the hook must look further at this call (argv without argv[0]). Malformed
    argv does: the full path reports it."""
    if len(argv) < 3:
        return True
    return (argv[1], argv[2]) in OPERATIONS and mentions_vmlend(xml)
