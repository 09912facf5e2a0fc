"""Declarative XML properties over lxml elements (the virtinst habit).

A class names the XML it models and nothing else::

    class Hostdev(XMLNode):
        uuid = XMLProperty("./source/address/@uuid")

Reading uses lxml's XPath; writing creates the missing elements of a simple path
(``./a/b/@attr``, ``./a/b`` for text). Elements the class does not model are never touched, so
they survive every rewrite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar, overload

from lxml import etree

from vmlend.errors import DomainXMLError

T = TypeVar("T")


def _qualify(step: str, namespaces: dict[str, str]) -> str:
    """``prefix:name`` -> Clark notation ``{uri}name`` for creating elements."""
    if ":" in step:
        prefix, local = step.split(":", 1)
        return f"{{{namespaces[prefix]}}}{local}"
    return step


def elements(
    el: etree._Element, path: str, namespaces: dict[str, str] | None = None
) -> list[etree._Element]:
    """The elements an XPath selects (lxml's ``xpath`` may also return strings or numbers)."""
    result = el.xpath(path, namespaces=namespaces or {})
    return [r for r in result if isinstance(r, etree._Element)] if isinstance(result, list) else []


class XMLProperty(Generic[T]):
    """One value at ``path`` relative to the node's element.

    ``parse`` turns the XML string into the Python value (errors become ``DomainXMLError``
    naming the path), ``format`` the other way. Assigning ``None`` removes the attribute, or the
    element for a text path.
    """

    @overload
    def __init__(self: XMLProperty[str], path: str) -> None: ...
    @overload
    def __init__(
        self, path: str, *, parse: Callable[[str], T], format: Callable[[T], str] = str
    ) -> None: ...
    def __init__(
        self,
        path: str,
        *,
        parse: Callable[[str], Any] = str,
        format: Callable[[Any], str] = str,
    ) -> None:
        if not path.startswith("./"):
            raise ValueError(f"XMLProperty path must start with './': {path!r}")
        self.path = path
        self.parse = parse
        self.format = format
        steps = path[2:].split("/")
        self.attr: str | None = steps[-1][1:] if steps[-1].startswith("@") else None
        self.steps = steps[:-1] if self.attr else steps
        self.name = path
        # Compiled once per namespace map: compiling dominates a plain lookup's cost.
        self._compiled: dict[tuple[tuple[str, str], ...], etree.XPath] = {}

    def _find(self, obj: XMLNode) -> list[Any]:
        key = tuple(sorted(obj.NAMESPACES.items()))
        xpath = self._compiled.get(key)
        if xpath is None:
            xpath = self._compiled[key] = etree.XPath(self.path, namespaces=obj.NAMESPACES)
        result = xpath(obj.element)
        return list(result) if isinstance(result, list) else []

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = f"{owner.__name__}.{name}"

    @overload
    def __get__(self, obj: None, owner: type) -> XMLProperty[T]: ...
    @overload
    def __get__(self, obj: XMLNode, owner: type) -> T | None: ...
    def __get__(self, obj: XMLNode | None, owner: type) -> Any:
        if obj is None:
            return self
        found = self._find(obj)
        if not found:
            return None
        raw = found[0] if self.attr else found[0].text
        if raw is None:
            return None
        try:
            return self.parse(str(raw).strip())
        except (ValueError, DomainXMLError) as e:
            tag = obj.element.tag
            qname = etree.QName(tag).localname if isinstance(tag, str) else "?"
            prefix = obj.element.prefix
            where = f"<{prefix}:{qname}>" if prefix else f"<{qname}>"
            raise DomainXMLError(f"bad value {raw!r} at {self.path} of {where}: {e}") from None

    def __set__(self, obj: XMLNode, value: T | None) -> None:
        if value is None:
            self._remove(obj)
            return
        el = obj.element
        for step in self.steps:
            if step == "":
                continue
            child = el.find(step, namespaces=obj.NAMESPACES)
            if child is None:
                child = etree.SubElement(el, _qualify(step, obj.NAMESPACES))
            el = child
        text = self.format(value)
        if self.attr:
            el.set(_qualify(self.attr, obj.NAMESPACES), text)
        else:
            el.text = text

    def _remove(self, obj: XMLNode) -> None:
        found = elements(obj.element, self.path.rsplit("/@", 1)[0], obj.NAMESPACES)
        if not found:
            return
        target = found[0]
        parent = target.getparent()
        if self.attr:
            key = _qualify(self.attr, obj.NAMESPACES)
            if key in target.attrib:
                del target.attrib[key]
        elif target is not obj.element and parent is not None:
            parent.remove(target)


class XMLNode:
    """Wraps one lxml element; subclasses declare ``XMLProperty`` attributes."""

    NAMESPACES: ClassVar[dict[str, str]] = {}

    def __init__(self, element: etree._Element) -> None:
        self.element = element
