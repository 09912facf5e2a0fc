"""Write an edited tree as its source bytes with only the edited parts changed.

lxml re-serialises a whole document in its own style (double quotes, ``&apos;`` as ``'``, CDATA
as text, namespace declarations moved, ``<a />`` as ``<a/>``, LF line ends), so a one-device
edit of ``virsh dumpxml`` output would touch many lines. Instead the edited tree is compared
with the tree parsed from the source, node by node: a subtree that did not change is copied from
the source verbatim, a changed element keeps its own start tag's untouched attributes, its text
runs and its end tag verbatim, and only new nodes and new values are written, in the document's
style (its attribute quote, its line ending). The result is checked by re-parsing; if it would
not give exactly the edited tree, lxml's own output is used instead.
"""

from __future__ import annotations

import difflib

import msgspec
from lxml import etree

from vmlend.domain.spans import AttributeSpan, NodeSpan


class Style(msgspec.Struct, frozen=True):
    """How the source writes what vmlend adds."""

    quote: str  # "'" (libvirt's) or '"'
    newline: bytes  # b"\n" or b"\r\n"
    encoding: str

    @classmethod
    def of(cls, source: bytes, encoding: str) -> Style:
        quote = "'" if source.count(b"='") > source.count(b'="') else '"'
        newline = b"\r\n" if b"\r\n" in source else b"\n"
        return cls(quote=quote, newline=newline, encoding=encoding)


def _parser() -> etree.XMLParser:
    return etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False)


def _key(node: etree._Element) -> bytes:
    return etree.tostring(node, with_tail=False)


def _blank(text: str | None) -> bool:
    return text is None or text.strip() == ""


class _Writer:
    def __init__(self, source: bytes, style: Style) -> None:
        self.source = source
        self.style = style

    # -- fresh output, in the document's style -------------------------------------------
    def _enc(self, text: str) -> bytes:
        data = text.encode(self.style.encoding, "xmlcharrefreplace")
        return data.replace(b"\r", b"&#13;").replace(b"\n", self.style.newline)

    def text(self, text: str | None) -> bytes:
        if not text:
            return b""
        return self._enc(text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))

    def attribute(self, name: str, value: str) -> bytes:
        q = self.style.quote
        escaped = value.replace("&", "&amp;").replace("<", "&lt;").replace(q, _QUOTE_REFS[q])
        escaped = escaped.replace("\n", "&#10;").replace("\t", "&#9;").replace("\r", "&#13;")
        return self._enc(f" {name}={q}{escaped}{q}")

    @staticmethod
    def _qname(node: etree._Element) -> str:
        qname = etree.QName(node)
        return f"{node.prefix}:{qname.localname}" if node.prefix else qname.localname

    @staticmethod
    def _attribute_name(node: etree._Element, key: str) -> str:
        qname = etree.QName(key)
        if qname.namespace is None:
            return key
        if qname.namespace == "http://www.w3.org/XML/1998/namespace":
            return f"xml:{qname.localname}"
        for prefix, uri in node.nsmap.items():
            if prefix and uri == qname.namespace:
                return f"{prefix}:{qname.localname}"
        raise ValueError(f"no prefix for attribute namespace {qname.namespace}")

    def _new_declarations(self, node: etree._Element, inherited: dict[str | None, str]) -> bytes:
        out = b""
        for prefix, uri in node.nsmap.items():
            if inherited.get(prefix) != uri:
                out += self.attribute(f"xmlns:{prefix}" if prefix else "xmlns", uri)
        return out

    def fresh(self, node: etree._Element) -> bytes:
        """``node`` (without its tail) written as libvirt writes XML, in the source's style."""
        if isinstance(node, etree._Comment):
            return b"<!--" + self._enc(node.text or "") + b"-->"
        if isinstance(node, etree._ProcessingInstruction):
            content = f"{node.target} {node.text}" if node.text else str(node.target)
            return b"<?" + self._enc(content) + b"?>"
        parent = node.getparent()
        inherited = dict(parent.nsmap) if parent is not None else {}
        name = self._qname(node).encode()
        head = b"<" + name + self._new_declarations(node, inherited)
        for key, value in node.attrib.items():
            head += self.attribute(self._attribute_name(node, key), value)
        if len(node) == 0 and not node.text:
            return head + b"/>"
        body = self.text(node.text)
        for child in node:
            body += self.fresh(child) + self.text(child.tail)
        return head + b">" + body + b"</" + name + b">"

    # -- splicing ------------------------------------------------------------------------
    def raw(self, start: int, end: int) -> bytes:
        return self.source[start:end]

    def node(self, new: etree._Element, old: etree._Element, span: NodeSpan) -> bytes:
        if _key(new) == _key(old):
            return self.raw(span.start, span.end)
        if not span.is_element or not isinstance(new.tag, str) or new.tag != old.tag:
            return self.fresh(new)
        head = self.head(new, old, span)
        if len(new) == 0 and not new.text:
            # Emptied: written as libvirt writes an empty element.
            return head + b"/>"
        if len(new) == 0 and len(old) == 0 and _blank(new.text) and _blank(old.text):
            # Only layout whitespace differs (an emptied element): keep the source's.
            body = b"" if span.self_closing else self.raw(span.head_end, span.close_start)
        else:
            body = self.content(new, old, span)
        if not span.self_closing:
            return head + b">" + body + self.raw(span.close_start, span.end)
        if not body:
            return head + b"/>"
        return head.rstrip() + b">" + body + b"</" + span.qname + b">"

    def head(self, new: etree._Element, old: etree._Element, span: NodeSpan) -> bytes:
        """The start tag up to (not including) ``>`` or ``/>``; just the source's own
        bytes when neither attributes nor namespaces changed."""
        same = list(new.attrib.items()) == list(old.attrib.items()) and new.nsmap == old.nsmap
        rest = span.head_rest.rstrip(b"/") if span.self_closing else span.head_rest
        if same:
            start = self.raw(span.start, span.head_end)
            cut = len(span.head_rest)
            return start[: len(start) - cut - 1] + rest
        out = b"<" + span.qname
        written: set[str] = set()
        for attr in span.attributes:
            if attr.is_namespace_declaration:
                out += attr.raw
                continue
            key = self._clark(attr, old)
            if key not in new.attrib:
                continue
            written.add(key)
            out += attr.raw if new.get(key) == old.get(key) else self._replace(attr, new, key)
        inherited = {p: u for p, u in old.nsmap.items()}
        out += self._new_declarations(new, inherited)
        for key, value in new.attrib.items():
            if key not in written:
                out += self.attribute(self._attribute_name(new, key), value)
        return out + rest

    @staticmethod
    def _clark(attr: AttributeSpan, old: etree._Element) -> str:
        name = attr.name.decode()
        if ":" not in name:
            return name
        prefix, local = name.split(":", 1)
        if prefix == "xml":
            return f"{{http://www.w3.org/XML/1998/namespace}}{local}"
        return f"{{{old.nsmap[prefix]}}}{local}"

    def _replace(self, attr: AttributeSpan, new: etree._Element, key: str) -> bytes:
        fresh = self.attribute(attr.name.decode(), new.get(key) or "")
        # Keep the source's own spacing before the name.
        return attr.space + fresh.lstrip()

    def content(self, new: etree._Element, old: etree._Element, span: NodeSpan) -> bytes:
        if (new.text or "") == (old.text or ""):
            out = self.raw(*span.text_range())
        else:
            out = self.text(new.text)
        old_children = list(old)
        for new_child, j in _pair(list(new), old_children):
            if j is None:
                out += self.fresh(new_child) + self.text(new_child.tail)
                continue
            out += self.node(new_child, old_children[j], span.children[j])
            if (new_child.tail or "") == (old_children[j].tail or ""):
                out += self.raw(*span.tail_range(j))
            else:
                out += self.text(new_child.tail)
        return out


_QUOTE_REFS = {"'": "&apos;", '"': "&quot;"}


_Pairs = list[tuple[etree._Element, int | None]]


def _pair(new: list[etree._Element], old: list[etree._Element]) -> _Pairs:
    """Each new child with the index of the old child it continues (None: it is new).
    Unchanged children pair by content; changed ones by tag, in order."""
    matcher = difflib.SequenceMatcher(
        a=[_key(x) for x in old], b=[_key(x) for x in new], autojunk=False
    )
    out: _Pairs = []
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            out.extend((new[b0 + k], a0 + k) for k in range(b1 - b0))
            continue
        free = list(range(a0, a1))
        for n in new[b0:b1]:
            match = next((j for j in free if old[j].tag == n.tag), None)
            if match is not None:
                free = [j for j in free if j > match]
            out.append((n, match))
    return out


def _c14n(data: bytes) -> bytes | None:
    try:
        root = etree.fromstring(data, _parser())
    except etree.XMLSyntaxError:
        return None
    return etree.tostring(root, method="c14n2", with_comments=True)


def splice(source: bytes, span: NodeSpan, new_root: etree._Element, encoding: str) -> bytes:
    """The root element ``new_root`` written over its source bytes ``source[span]``: untouched
    parts verbatim, edited ones in the source's style. Falls back to lxml's serialisation of
    the root when the splice would not parse back to the same tree."""
    old_root = etree.fromstring(source, _parser())
    writer = _Writer(source, Style.of(source, encoding))
    fallback = etree.tostring(new_root, encoding=encoding, with_tail=False, xml_declaration=False)
    try:
        merged = writer.node(new_root, old_root, span)
    except (ValueError, KeyError, UnicodeError):
        return fallback
    if merged == source[span.start : span.end]:
        return merged
    if _c14n(merged) != _c14n(fallback):
        return fallback
    return merged
