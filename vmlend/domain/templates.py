"""The XML templates in ``xml-templates/`` (shipped as package data in ``vmlend/data``).

Templates are complete, schema-valid XML with placeholder values; code fills them through the
XML properties of ``model``, never by pasting strings.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path

import msgspec
from lxml import etree

from vmlend.errors import ConfigError, HostError
from vmlend.safefile import read_regular

MACHINES = ("q35", "pc")


def default_template_dir() -> Path:
    """The templates inside the installed package (editable or not)."""
    return Path(str(resources.files("vmlend.data") / "xml-templates"))


class TemplateSet(msgspec.Struct):
    """Loads and caches the templates of one directory; hands out fresh copies."""

    directory: Path = msgspec.field(default_factory=default_template_dir)
    _cache: dict[str, etree._Element] = msgspec.field(default_factory=dict)

    def __repr__(self) -> str:  # the cache is how the set works, not what it is
        return f"TemplateSet(directory={self.directory!r})"

    def load(self, name: str) -> etree._Element:
        """A private copy of the root element of ``<directory>/<name>.xml``."""
        if name not in self._cache:
            path = self.directory / f"{name}.xml"
            try:
                data = read_regular(path)  # a FIFO or device is refused, not read
            except OSError as e:
                raise HostError(
                    f"cannot read XML template {path}: {e.strerror}; the vmlend installation"
                    " may be incomplete (reinstall it)"
                ) from None
            parser = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False)
            try:
                self._cache[name] = etree.fromstring(data, parser)
            except etree.XMLSyntaxError as e:
                raise HostError(f"XML template {path} is broken: {e}") from None
        return copy.deepcopy(self._cache[name])

    def domain(self, machine: str) -> etree._Element:
        if machine not in MACHINES:
            raise ConfigError(
                f"unknown machine type {machine!r}; choose one of {', '.join(MACHINES)}"
            )
        return self.load(f"domain-{machine}")

    def hostdev(self) -> etree._Element:
        return self.load("hostdev-mdev")

    def disk(self) -> etree._Element:
        return self.load("disk-file")
