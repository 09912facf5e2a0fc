"""Where each node of a parsed document lies in its source bytes.

lxml tells where an element starts (its line) but not where it ends, nor how its start tag, its
attributes and the text around it were spelled. The splicer in ``preserve`` needs exactly that
to copy untouched parts verbatim, so this module scans the (already well-formed) source once and
returns a tree of spans in the same order as lxml's nodes: elements, comments and processing
instructions. CDATA sections, character references and entity references are text.
"""

from __future__ import annotations

import re

import msgspec

_COMMENT_END = b"-->"
_PI_END = b"?>"
_CDATA_END = b"]]>"
_NAME = rb"[^\s/>=]+"
_START_TAG = re.compile(
    rb"<(" + _NAME + rb")((?:\s+" + _NAME + rb"\s*=\s*(?:\"[^\"]*\"|'[^']*'))*)(\s*/?)>"
)
_ATTRIBUTE = re.compile(rb"(\s+)(" + _NAME + rb")(\s*=\s*)(\"[^\"]*\"|'[^']*')")
_END_TAG = re.compile(rb"</" + _NAME + rb"\s*>")


class AttributeSpan(msgspec.Struct, frozen=True):
    """One attribute (or namespace declaration) as written: ``<space><name><eq><quoted>``."""

    space: bytes
    name: bytes
    equals: bytes
    quoted: bytes

    @property
    def raw(self) -> bytes:
        return self.space + self.name + self.equals + self.quoted

    @property
    def is_namespace_declaration(self) -> bool:
        return self.name == b"xmlns" or self.name.startswith(b"xmlns:")


class NodeSpan(msgspec.Struct):
    """An element, comment or PI. For elements: ``start..head_end`` is the start tag,
    ``close_start..end`` the end tag (empty for ``<a/>``); the content lies in between."""

    start: int
    end: int
    head_end: int
    close_start: int
    is_element: bool
    self_closing: bool = False
    qname: bytes = b""
    attributes: list[AttributeSpan] = msgspec.field(default_factory=list)
    #: Bytes between the last attribute and ``>`` (``" /"`` in ``<model type='x' />``).
    head_rest: bytes = b""
    children: list[NodeSpan] = msgspec.field(default_factory=list)

    def text_range(self) -> tuple[int, int]:
        """Where the text before the first child lies."""
        first = self.children[0].start if self.children else self.close_start
        return self.head_end, first

    def tail_range(self, index: int) -> tuple[int, int]:
        """Where the tail of child ``index`` lies."""
        child = self.children[index]
        nxt = self.children[index + 1].start if index + 1 < len(self.children) else None
        return child.end, self.close_start if nxt is None else nxt


def _skip_to(data: bytes, pos: int, marker: bytes) -> int:
    end = data.find(marker, pos)
    if end < 0:
        raise ValueError(f"unterminated markup at byte {pos}")
    return end + len(marker)


def scan_element(data: bytes, pos: int) -> NodeSpan:
    """The span tree of the element whose start tag begins at ``pos``."""
    stack: list[NodeSpan] = []
    root: NodeSpan | None = None
    i = pos
    while True:
        lt = data.find(b"<", i)
        if lt < 0:
            raise ValueError("unexpected end of document inside an element")
        if data.startswith(b"<!--", lt):
            end = _skip_to(data, lt + 4, _COMMENT_END)
            stack[-1].children.append(NodeSpan(lt, end, end, end, is_element=False))
            i = end
        elif data.startswith(b"<![CDATA[", lt):
            i = _skip_to(data, lt + 9, _CDATA_END)
        elif data.startswith(b"<?", lt):
            end = _skip_to(data, lt + 2, _PI_END)
            stack[-1].children.append(NodeSpan(lt, end, end, end, is_element=False))
            i = end
        elif data.startswith(b"</", lt):
            m = _END_TAG.match(data, lt)
            if m is None or not stack:
                raise ValueError(f"bad end tag at byte {lt}")
            node = stack.pop()
            node.close_start, node.end = lt, m.end()
            if not stack:
                return node
            i = m.end()
        else:
            m = _START_TAG.match(data, lt)
            if m is None:
                raise ValueError(f"bad start tag at byte {lt}")
            attributes = [AttributeSpan(*a.groups()) for a in _ATTRIBUTE.finditer(m.group(2))]
            closing = m.group(3).endswith(b"/")
            node = NodeSpan(
                start=lt,
                end=m.end(),
                head_end=m.end(),
                close_start=m.end(),
                is_element=True,
                self_closing=closing,
                qname=m.group(1),
                attributes=attributes,
                head_rest=m.group(3),
            )
            if stack:
                stack[-1].children.append(node)
            else:
                root = node
            if closing:
                if root is node:
                    return node
            else:
                stack.append(node)
            i = m.end()
