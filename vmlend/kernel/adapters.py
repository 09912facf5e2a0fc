"""This host's NTB adapters as the SmartIO driver publishes them (docs/smartio-contract.md,
section 1, "This host's NTB adapters and their cables").

    class/smartio/adapter<index>/   index model window_size segments lut_entries link peer
                                    switch_port

Reading only; every value is checked as the contract states it, and a damaged one is a
``SysfsAttributeError`` naming the file: a topology built from a wrong value would misplace
every DMA window on the adapter.
"""

from __future__ import annotations

import re
from pathlib import Path

from vmlend.errors import SysfsAttributeError
from vmlend.hostenv import HostEnv
from vmlend.kernel.driver import ADAPTER_MAX, CHECK, NODE_ID_MAX, NODE_ID_MIN
from vmlend.kernel.sysfsattr import is_directory, parse_number, read_number, read_value
from vmlend.topology.discovered import FoundAdapter
from vmlend.topology.parse import MAX_ADDRESS, PAGE

#: ``adapter<index>``, the index in decimal without leading zeros (one adapter, one name).
_NAME_RE = re.compile(r"^adapter(0|[1-9][0-9]?)$")
#: A product name: one word, as a topology file's ``model`` is shown.
_MODEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,31}")
MAX_SEGMENTS = 4096
MAX_LUT_ENTRIES = 4096
MAX_SWITCH_PORT = 255
LINK_STATES = ("up", "down")


def adapter_name(index: int) -> str:
    return f"adapter{index}"


def adapter_indexes(env: HostEnv) -> list[int]:
    """The indexes of the adapters the driver lists, ascending."""
    base = env.smartio
    if not base.is_dir():
        return []
    found = []
    for p in base.iterdir():
        m = _NAME_RE.match(p.name)
        if m is None:
            continue
        if int(m.group(1)) > ADAPTER_MAX:
            raise SysfsAttributeError(
                p, f"an adapter index is at most {ADAPTER_MAX}, the directory says {m.group(1)}",
                CHECK,
            )
        found.append(int(m.group(1)))
    return sorted(found)


def _power_of_two(path: Path, value: int, what: str) -> None:
    if value & (value - 1):
        raise SysfsAttributeError(path, f"{what} must be a power of two, got {value}", CHECK)


def read_adapter(env: HostEnv, index: int) -> FoundAdapter:
    d = env.smartio / adapter_name(index)
    if not is_directory(d, CHECK):
        raise SysfsAttributeError(d, "missing: the adapter went away while it was read", CHECK)
    try:
        return _read(d, index)
    except FileNotFoundError as e:
        raise SysfsAttributeError(
            e.filename, f"missing: adapter {index} lacks attribute {Path(e.filename).name}", CHECK
        ) from None


def _read(d: Path, index: int) -> FoundAdapter:
    said = read_number(d / "index", 0, ADAPTER_MAX, "an adapter index", CHECK)
    if said != index:
        raise SysfsAttributeError(d / "index", f"says {said}, but its directory is {d.name}", CHECK)
    model = read_value(d / "model", CHECK)
    if not _MODEL_RE.fullmatch(model):
        raise SysfsAttributeError(
            d / "model",
            f"expected a product name (one word of letters, digits, '-', '_', '.', '+', at most"
            f" 32), got {model[:40]!r}",
            CHECK,
        )
    window = read_number(d / "window_size", PAGE, MAX_ADDRESS, "a window size in bytes", CHECK)
    _power_of_two(d / "window_size", window, "the window size")
    segments = read_number(d / "segments", 1, MAX_SEGMENTS, "a segment count", CHECK)
    _power_of_two(d / "segments", segments, "the segment count")
    if window // segments < PAGE:
        raise SysfsAttributeError(
            d / "segments",
            f"{segments} segments of a {window}-byte window are smaller than a page",
            CHECK,
        )
    lut = read_number(d / "lut_entries", 1, MAX_LUT_ENTRIES, "a LUT entry count", CHECK)
    link = read_value(d / "link", CHECK)
    if link not in LINK_STATES:
        raise SysfsAttributeError(
            d / "link", f"expected up or down, got {link[:40]!r}", CHECK
        )
    # an empty line: nothing (no link, or the other kind of cable)
    peer_text = read_value(d / "peer", CHECK)
    port_text = read_value(d / "switch_port", CHECK)
    peer = _peer(d / "peer", peer_text) if peer_text else None
    port = (
        parse_number(d / "switch_port", port_text, 0, MAX_SWITCH_PORT, "a switch port", CHECK)
        if port_text
        else None
    )
    if peer is not None and port is not None:
        raise SysfsAttributeError(
            d / "switch_port", "a cable leads to a peer adapter or to a switch port, not both",
            CHECK,
        )
    if link == "down" and (peer is not None or port is not None):
        raise SysfsAttributeError(
            d / "link", "down, yet the adapter names what its cable leads to", CHECK
        )
    return FoundAdapter(
        index=index,
        model=model,
        window_size=window,
        segments=segments,
        lut_entries=lut,
        link_up=link == "up",
        peer=peer,
        switch_port=port,
    )


def _peer(path: Path, text: str) -> tuple[int, int]:
    words = text.split()
    if len(words) != 2:
        raise SysfsAttributeError(
            path, f"expected '<node id> <adapter index>' or nothing, got {text[:40]!r}", CHECK
        )
    node_id = parse_number(path, words[0], NODE_ID_MIN, NODE_ID_MAX, "a node id", CHECK)
    index = parse_number(path, words[1], 0, ADAPTER_MAX, "an adapter index", CHECK)
    return node_id, index


def read_adapters(env: HostEnv) -> list[FoundAdapter]:
    """Every adapter the driver lists; the first damaged one is an error."""
    return [read_adapter(env, i) for i in adapter_indexes(env)]
