"""What a user asks for when vmlend chooses devices, as Nova and KubeVirt administrators ask:
a selector (``gpu``, ``gpu:2``, ``nvme,lender=alpha``, ``vendor=10de,product=1db4``, ``a100``)
and the configuration file's ``[alias]`` table, which names vendor/product pairs as Nova's
``[pci] alias`` does (``a100 = { vendor = "10de", product = "20b0" }``). Pure: parsing here,
and ``resolve`` turns a selector into what a device must be, given the fabric's kinds.

A vendor id alone is refused, in a selector and in an alias: it matches every function of the
vendor (a GPU and its HDMI audio function, any of Intel's NICs and drives), so the closest one
would be chosen, rarely the one meant; a kind says "any of these" instead. A product id means
nothing without its vendor. An alias that has the name of one of the fabric's kinds is refused
when it is used, so that ``--device gpu`` means one thing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import msgspec

from vmlend.errors import ConfigError
from vmlend.topology.model import DeviceSpec

#: A kind or alias name: what the topology's kinds look like (``gpu``, ``root-port``).
_NAME = re.compile(r"[a-z][a-z0-9_-]*")
#: A PCI vendor or product id: 1-4 hex digits, with or without 0x (``lspci -nn`` shows 10de).
_PCI_ID = re.compile(r"(?:0[xX])?([0-9a-fA-F]{1,4})")
#: The most devices one selector asks for.
MAX_COUNT = 64
_ATTRS = ("lender", "vendor", "product", "count")
_HINT = (
    "give an fdid (0x10), a kind or alias with an optional count (gpu, gpu:2, a100), or"
    " vendor=HEX,product=HEX; add lender=NODE to narrow"
)


def parse_pci_id(value: object, what: str) -> int:
    """A PCI vendor or product id: ``"10de"``, ``"0x10DE"`` or a TOML integer (0x10de).
    ``ConfigError`` saying what one looks like. 0xffff is what a missing device reads: no id."""
    if isinstance(value, str) and (m := _PCI_ID.fullmatch(value)):
        number = int(m[1], 16)
    elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0xFFFF:
        number = value
    else:
        raise ConfigError(
            f"bad {what} id {value!r}: give 4 hex digits as lspci -nn shows them (10de or 0x10de)"
        )
    if number == 0xFFFF:
        raise ConfigError(f"bad {what} id {value!r}: ffff is what a missing device reads, no id")
    return number


def format_pci_id(number: int) -> str:
    return f"{number:04x}"


class Alias(msgspec.Struct, frozen=True):
    """A name for one vendor/product pair (the configuration file's ``[alias]``)."""

    vendor: int
    product: int

    def __str__(self) -> str:
        return f"vendor={format_pci_id(self.vendor)},product={format_pci_id(self.product)}"


def parse_aliases(table: object, where: str) -> dict[str, Alias]:
    """The ``[alias]`` table of the configuration file ``where``: each key a name, each value
    ``{ vendor = "10de", product = "20b0" }`` (hex strings or integers). ``ConfigError`` naming
    the alias and the file for anything else."""
    if not isinstance(table, dict):
        raise ConfigError(
            f'{where}: alias must be a table ([alias] with lines a100 = {{ vendor = "10de",'
            ' product = "20b0" }})'
        )
    out: dict[str, Alias] = {}
    for name, entry in table.items():
        if not _NAME.fullmatch(name):
            raise ConfigError(
                f"{where}: alias {name!r} is no name vmlend can read in --device (lower-case"
                " letters, digits, - and _, starting with a letter); rename it"
            )
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{where}: alias.{name} = {entry!r} must be a table:"
                f' {name} = {{ vendor = "10de", product = "20b0" }}'
            )
        unknown = sorted(set(entry) - {"vendor", "product"})
        if unknown:
            raise ConfigError(
                f"{where}: alias.{name} has {', '.join(unknown)}; an alias takes vendor and"
                " product only"
            )
        if "vendor" not in entry or "product" not in entry:
            missing = "product" if "vendor" in entry else "vendor"
            raise ConfigError(
                f"{where}: alias.{name} has no {missing}; give both vendor and product (a vendor"
                " alone matches every function it makes; a kind does that job)"
            )
        try:
            out[name] = Alias(
                parse_pci_id(entry["vendor"], "vendor"), parse_pci_id(entry["product"], "product")
            )
        except ConfigError as e:
            raise ConfigError(f"{where}: alias.{name}: {e}") from None
    return out


class DeviceWish(msgspec.Struct, frozen=True):
    """``count`` available devices named ``name`` (a kind or an alias) and/or of ``vendor`` and
    ``product``, from ``lender`` when given: a selector as typed, before ``resolve``."""

    name: str | None
    count: int = 1
    lender: str | None = None
    vendor: int | None = None
    product: int | None = None

    def __str__(self) -> str:
        parts = [f"{self.name}:{self.count}"] if self.name else []
        if self.vendor is not None and self.product is not None:
            parts.append(
                f"vendor={format_pci_id(self.vendor)},product={format_pci_id(self.product)}"
            )
        if self.lender:
            parts.append(f"lender={self.lender}")
        if not self.name:
            parts.append(f"count={self.count}")
        return ",".join(parts)


def parse_wish(text: str) -> DeviceWish | None:
    """A selector: ``gpu``, ``gpu:2``, ``nvme,lender=alpha``, ``a100:2``,
    ``vendor=10de,product=1db4[,count=2]`` -> a wish; None for anything that starts like a
    device id (a digit), which the caller parses as one. ``ConfigError`` for a bad selector."""
    text = text.strip()
    if not text or text[0].isdigit():
        return None
    head, *attrs = text.lower().split(",")
    name: str | None = None
    count: int | None = None
    if "=" in head:
        attrs.insert(0, head)
    else:
        name, colon, number = head.partition(":")
        if not _NAME.fullmatch(name) or (colon and not number.isdigit()):
            raise ConfigError(f"bad device {text!r}: {_HINT}")
        if colon:
            count = _count(text, number)
    given: dict[str, str] = {}
    for attr in attrs:
        key, eq, value = attr.partition("=")
        if key not in _ATTRS or not eq or not value:
            raise ConfigError(
                f"bad device {text!r}: {attr!r} is not an attribute vmlend chooses by"
                " (lender=NODE, vendor=HEX, product=HEX, count=N)"
            )
        if key in given:
            raise ConfigError(f"bad device {text!r}: {key}= is given twice; keep one")
        given[key] = value
    if "count" in given:
        if count is not None:
            raise ConfigError(f"bad device {text!r}: a count after ':' and count= too; keep one")
        count = _count(text, given["count"])
    try:
        vendor = parse_pci_id(given["vendor"], "vendor") if "vendor" in given else None
        product = parse_pci_id(given["product"], "product") if "product" in given else None
    except ConfigError as e:
        raise ConfigError(f"bad device {text!r}: {e}") from None
    if (vendor is None) != (product is None):
        raise ConfigError(
            f"bad device {text!r}: give vendor= and product= together (a vendor alone matches"
            " every function it makes; ask by kind for any device of one sort)"
        )
    if name is None and vendor is None:
        raise ConfigError(f"bad device {text!r}: {_HINT}")
    return DeviceWish(name, 1 if count is None else count, given.get("lender"), vendor, product)


def _count(text: str, number: str) -> int:
    if not number.isdigit() or not 1 <= int(number) <= MAX_COUNT:
        raise ConfigError(f"bad device {text!r}: ask for 1 to {MAX_COUNT} devices at a time")
    return int(number)


class Criteria(msgspec.Struct, frozen=True):
    """What a device must be to satisfy one wish, resolved against the aliases and kinds."""

    kind: str | None
    vendor: int | None
    product: int | None
    lender: str | None

    def matches(self, spec: DeviceSpec) -> bool:
        return (
            (self.kind is None or spec.kind == self.kind)
            and (self.vendor is None or spec.vendor_id == self.vendor)
            and (self.product is None or spec.device_id == self.product)
            and (self.lender is None or spec.lender == self.lender)
        )


def resolve(wish: DeviceWish, aliases: Mapping[str, Alias], kinds: Iterable[str]) -> Criteria:
    """``wish`` as the device it wants: its name read as one of ``kinds`` (the fabric's) or
    an alias. ``ConfigError`` for a name that is neither, an alias named like a kind, or an
    alias given ids again."""
    kinds = sorted(set(kinds))
    if wish.name is None:
        return Criteria(None, wish.vendor, wish.product, wish.lender)
    alias = aliases.get(wish.name)
    if alias is not None and wish.name in kinds:
        raise ConfigError(
            f"alias {wish.name!r} ([alias] in the configuration file) has the name of the"
            f" fabric's device kind {wish.name!r}; rename the alias so that {wish.name} means"
            " one thing"
        )
    if alias is not None:
        if wish.vendor is not None:
            raise ConfigError(
                f"bad device {str(wish)!r}: alias {wish.name!r} already names {alias}; drop"
                " vendor= and product=, or the alias"
            )
        return Criteria(None, alias.vendor, alias.product, wish.lender)
    if wish.name in kinds:
        return Criteria(wish.name, wish.vendor, wish.product, wish.lender)
    named = f"; aliases: {', '.join(sorted(aliases))}" if aliases else ""
    raise ConfigError(
        f"no device kind or alias {wish.name!r} in the fabric (its kinds: {', '.join(kinds)}"
        f"{named}); [alias] in the configuration file names vendor/product pairs"
    )
