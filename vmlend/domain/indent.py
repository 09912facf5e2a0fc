"""Insert and remove elements in the indentation style the document already uses.

A document that is indented (libvirt's ``virsh dumpxml``, our templates) gets new elements
indented like their siblings; a compact one stays compact. Removing an element takes its
whitespace with it, so add-then-remove gives back the original bytes.
"""

from __future__ import annotations

import copy

from lxml import etree

_DEFAULT_UNIT = "  "


def _is_blank(text: str | None) -> bool:
    return text is None or text.strip() == ""


def _indent_of(el: etree._Element) -> str | None:
    """The whitespace after the last newline before ``el``'s start tag, if it is indented."""
    prev = el.getprevious()
    parent = el.getparent()
    if prev is not None:
        before = prev.tail
    elif parent is not None:
        before = parent.text
    else:
        return None
    if before is None or "\n" not in before or not _is_blank(before):
        return None
    return before.rsplit("\n", 1)[1]


def _indent_unit(parent: etree._Element) -> str:
    """Guess one indentation step from the nearest indented parent/child pair."""
    for el in parent.iter():
        if not isinstance(el.tag, str) or len(el) == 0:
            continue
        outer = _indent_of(el) if el.getparent() is not None else ""
        inner = _indent_of(el[0])
        if outer is not None and inner is not None and len(inner) > len(outer):
            return inner[len(outer) :]
    return _DEFAULT_UNIT


def _reindent(el: etree._Element, base: str) -> None:
    """Shift an indented subtree (written at column 0) to start at ``base``."""
    for node in el.iter():
        if node is not el and node.tail is not None and _is_blank(node.tail):
            node.tail = node.tail.replace("\n", "\n" + base)
        if node.text is not None and _is_blank(node.text) and len(node):
            node.text = node.text.replace("\n", "\n" + base)


def _strip_blank(el: etree._Element) -> None:
    for node in el.iter():
        if _is_blank(node.text) and len(node):
            node.text = None
        if node is not el and _is_blank(node.tail):
            node.tail = None


def is_indented(parent: etree._Element) -> bool:
    root = parent.getroottree().getroot()
    return root.text is not None and "\n" in root.text


def insert_child(
    parent: etree._Element, child: etree._Element, index: int | None = None
) -> etree._Element:
    """Insert a copy of ``child`` into ``parent`` at ``index`` (default: end), laid out like its
    future siblings. Returns the inserted element."""
    child = copy.deepcopy(child)
    child.tail = None
    n = len(parent)
    index = n if index is None else max(0, min(index, n))
    if not is_indented(parent):
        _strip_blank(child)
        parent.insert(index, child)
        return child
    parent_indent = _indent_of(parent) if parent.getparent() is not None else ""
    parent_indent = parent_indent or ""
    unit = _indent_unit(parent.getroottree().getroot())
    child_indent = parent_indent + unit
    _reindent(child, child_indent)
    if n == 0:
        parent.text = "\n" + child_indent
        child.tail = "\n" + parent_indent
    elif index == n:
        last = parent[n - 1]
        child.tail = last.tail
        last.tail = "\n" + child_indent
    else:
        child.tail = "\n" + child_indent
    parent.insert(index, child)
    return child


def remove_child(child: etree._Element) -> None:
    """Remove ``child`` and the whitespace that separated it from its neighbours."""
    parent = child.getparent()
    if parent is None:
        return
    prev = child.getprevious()
    is_last = child.getnext() is None
    tail = child.tail
    if prev is not None:
        if is_last:
            prev.tail = tail if _is_blank(tail) else (prev.tail or "") + (tail or "")
        elif not _is_blank(tail):
            prev.tail = (prev.tail or "") + (tail or "")
    elif is_last:
        # The only child: the parent becomes empty. An indented parent keeps the line break
        # before its end tag, as libvirt writes an empty <devices>.
        if _is_blank(parent.text) and _is_blank(tail):
            parent.text = tail if tail and "\n" in tail else None
    elif not _is_blank(tail):
        parent.text = (parent.text or "") + (tail or "")
    parent.remove(child)
