"""What the hook reads from the domain XML, via ``vmlend.domain``'s read and rewrite modules
(imported one by one: the hook does not pay for templates and builders)."""

from __future__ import annotations

from vmlend.domain.info import DomainXMLInfo, has_vmlend_metadata, read_domain


def read_hook_domain(xml: bytes, *, strict: bool = True) -> DomainXMLInfo | None:
    """The domain, or None when it carries no vmlend metadata (the hook then touches nothing).

    ``strict=False`` is for returning devices: an inconsistent XML must not keep a device
    borrowed forever. Malformed XML raises ``DomainXMLError`` either way."""
    if not has_vmlend_metadata(xml, source="domain XML on stdin"):
        return None
    return read_domain(xml, strict=strict, source="domain XML on stdin")


def rewrite_for_this_host(xml: bytes, node: str) -> bytes:
    from vmlend.domain.rewrite import rewrite_for_destination

    return rewrite_for_destination(xml, node, source="domain XML on stdin")
