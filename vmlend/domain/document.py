"""Parse domain XML bytes into an lxml tree and serialise it back, changing as little as possible.

``DomainDocument`` keeps the source bytes next to the tree: what lies outside the root element
(declaration, comments before and after it, the final newline) is written back verbatim, and the
root element is spliced over its source (``preserve``), so a document that was not changed
serialises to exactly its input and a changed one differs only where it was changed.
"""

from __future__ import annotations

import copy

import msgspec
from lxml import etree

from vmlend.errors import DomainXMLError


def _parser() -> etree.XMLParser:
    # Libvirt domain XML never needs a DTD or entities; refusing them keeps parsing safe for
    # XML that arrives on a hook's stdin. A new parser per call: lxml parsers are not safe to
    # share between threads.
    return etree.XMLParser(
        resolve_entities=False,
        no_network=True,
        load_dtd=False,
        remove_blank_text=False,
        huge_tree=False,
    )


def _serialise(node: etree._Element, encoding: str) -> bytes:
    data = etree.tostring(node, encoding=encoding, with_tail=False, xml_declaration=False)
    assert isinstance(data, bytes)  # an explicit encoding always gives bytes
    return data


def _prolog_length(data: bytes) -> int:
    """Bytes before the root's start tag: whitespace, the declaration, comments, PIs."""
    i = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # a UTF-8 byte order mark
    n = len(data)
    while i < n:
        if data[i : i + 1].isspace():
            i += 1
        elif data.startswith(b"<?", i):
            end = data.find(b"?>", i)
            i = n if end < 0 else end + 2
        elif data.startswith(b"<!--", i):
            end = data.find(b"-->", i)
            i = n if end < 0 else end + 3
        elif data.startswith(b"<!", i):
            end = data.find(b">", i)
            i = n if end < 0 else end + 1
        else:
            break
    return i


class DomainDocument(msgspec.Struct):
    """A parsed domain: the root element plus the verbatim bytes around it."""

    root: etree._Element
    encoding: str = "UTF-8"
    #: The whole document as parsed, to keep every untouched byte on output.
    source: bytes = b""

    @classmethod
    def parse(cls, data: bytes | str, *, source: str = "domain XML") -> DomainDocument:
        """Parse ``data``; malformed XML or a non-``<domain>`` root raise ``DomainXMLError``."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        if not data.strip():
            raise DomainXMLError(f"{source} is empty; expected a libvirt <domain> document")
        try:
            root = etree.fromstring(data, _parser())
        except etree.XMLSyntaxError as e:
            line = e.lineno if e.lineno else "?"
            msg = e.msg.splitlines()[0] if e.msg else "syntax error"
            raise DomainXMLError(f"{source} is not well-formed XML (line {line}): {msg}") from None
        if root.tag != "domain":
            raise DomainXMLError(
                f"{source} has root element <{root.tag!s}>, expected a libvirt <domain>"
            )
        docinfo = root.getroottree().docinfo
        if docinfo.doctype or docinfo.internalDTD is not None:
            # libvirt never writes one; entities in a DTD could point outside the document.
            raise DomainXMLError(f"{source} has a DOCTYPE; libvirt domain XML has none")
        encoding = docinfo.encoding or "UTF-8"
        return cls(root=root, encoding=encoding, source=data)

    @classmethod
    def from_element(cls, root: etree._Element) -> DomainDocument:
        """A new document for a tree built in memory, written as lxml writes it."""
        return cls.parse(_serialise(root, "UTF-8") + b"\n")

    def copy(self) -> DomainDocument:
        """A deep copy, so rewrites can stay pure."""
        return DomainDocument(
            root=copy.deepcopy(self.root),
            encoding=self.encoding,
            source=self.source,
        )

    def to_bytes(self) -> bytes:
        # Loaded here: reading a domain (the hook's prepare and release) never writes it.
        from vmlend.domain.preserve import splice
        from vmlend.domain.spans import scan_element

        if not self.source:
            return _serialise(self.root, self.encoding)
        try:
            span = scan_element(self.source, _prolog_length(self.source))
        except ValueError:
            # Not expected for input lxml accepted; lxml's spelling is still the same tree.
            return _serialise(self.root, self.encoding)
        # Rewrites edit the root element only: what surrounds it (declaration, comments
        # before and after it, the final newline) is the source's.
        body = splice(self.source, span, self.root, self.encoding)
        return self.source[: span.start] + body + self.source[span.end :]
