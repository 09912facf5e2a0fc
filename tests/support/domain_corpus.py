"""A generator of varied domain XML, written the way libvirt writes it (``virsh dumpxml``), plus
the hand edits users make to such files (CRLF, comments, CDATA, double quotes, ``<a />``).

Each document comes from a seed, so a failure names a document that can be rebuilt. The base
documents follow libvirt's own formatting (domain_conf.c): two-space indentation, single-quoted
attributes, elements in libvirt's order, ``&apos;``/``&quot;`` escapes, empty ``<devices>`` on
two lines, other tools' metadata as xmlNodeDump writes it (double quotes, comments and CDATA
kept).
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_SINGLE_QUOTED = re.compile(r"(\s[\w:.-]+)='([^']*)'")
_DESCRIPTION = 'It\'s a "test" & more'
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
OSINFO_NS = "http://libosinfo.org/xmlns/libvirt/domain/1.0"


def _esc(text: str) -> str:
    # libvirt's virBufferEscapeString: all five entities, in text and attributes alike.
    for a, b in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("'", "&apos;"), ('"', "&quot;")):
        text = text.replace(a, b)
    return text


class _Slots:
    """Free guest PCI slots on bus 0 (libvirt writes every device's address)."""

    def __init__(self, machine: str) -> None:
        reserved = {0, 1, 2} if machine.startswith("pc-i440fx") else {0, 1, 0x1F}
        self.free = [s for s in range(3, 0x1E) if s not in reserved]

    def take(self, rng: random.Random) -> str:
        slot = self.free.pop(rng.randrange(len(self.free)))
        return f"<address type='pci' domain='0x0000' bus='0x00' slot='{slot:#04x}' function='0x0'/>"


def _disk(rng: random.Random, i: int, slots: _Slots) -> list[str]:
    path = rng.choice(["/var/lib/libvirt/images/vm{i}.qcow2", '/srv/it\'s & "quoted" {i}.img'])
    fmt = "qcow2" if path.endswith("qcow2") else "raw"
    return [
        "<disk type='file' device='disk'>",
        f"  <driver name='qemu' type='{fmt}'/>",
        f"  <source file='{_esc(path.format(i=i))}'/>",
        f"  <target dev='vd{'abcdefgh'[i]}' bus='virtio'/>",
        f"  {slots.take(rng)}",
        "</disk>",
    ]


def _interface(rng: random.Random, i: int, slots: _Slots) -> list[str]:
    mac = f"52:54:00:{rng.randrange(256):02x}:{rng.randrange(256):02x}:{i:02x}"
    return [
        "<interface type='bridge'>",
        f"  <mac address='{mac}'/>",
        "  <source bridge='br0'/>",
        "  <model type='virtio'/>",
        f"  {slots.take(rng)}",
        "</interface>",
    ]


def _serial(rng: random.Random, i: int, slots: _Slots) -> list[str]:
    return [
        "<serial type='pty'>",
        f"  <target type='isa-serial' port='{i}'>",
        "    <model name='isa-serial'/>",
        "  </target>",
        "</serial>",
    ]


def _foreign_mdev(rng: random.Random, i: int, slots: _Slots) -> list[str]:
    # A local vGPU: an mdev hostdev that is not vmlend's.
    u = uuid.UUID(int=rng.getrandbits(128), version=4)
    return [
        "<hostdev mode='subsystem' type='mdev' managed='no' model='vfio-pci' display='off'>",
        "  <source>",
        f"    <address uuid='{u}'/>",
        "  </source>",
        f"  {slots.take(rng)}",
        "</hostdev>",
    ]


def _pci_hostdev(rng: random.Random, i: int, slots: _Slots) -> list[str]:
    return [
        "<hostdev mode='subsystem' type='pci' managed='yes'>",
        "  <source>",
        f"    <address domain='0x0000' bus='0x{rng.randrange(1, 0x80):02x}' slot='0x00'"
        " function='0x0'/>",
        "  </source>",
        f"  {slots.take(rng)}",
        "</hostdev>",
    ]


def _video(rng: random.Random, i: int, slots: _Slots) -> list[str]:
    if rng.random() < 0.5:
        return ["<video>", "  <model type='none'/>", "</video>"]
    return [
        "<video>",
        "  <model type='virtio' heads='1' primary='yes'/>",
        f"  {slots.take(rng)}",
        "</video>",
    ]


def _misc(rng: random.Random, i: int, slots: _Slots) -> list[str]:
    return rng.choice(
        [
            ["<input type='mouse' bus='ps2'/>", "<input type='keyboard' bus='ps2'/>"],
            [
                "<graphics type='vnc' port='-1' autoport='yes' listen='127.0.0.1'>",
                "  <listen type='address' address='127.0.0.1'/>",
                "</graphics>",
            ],
            [
                "<rng model='virtio'>",
                "  <backend model='random'>/dev/urandom</backend>",
                f"  {slots.take(rng)}",
                "</rng>",
            ],
            ["<watchdog model='i6300esb' action='reset'>", f"  {slots.take(rng)}", "</watchdog>"],
        ]
    )


_DEVICE_KINDS: list[Callable[[random.Random, int, _Slots], list[str]]] = [
    _disk,
    _interface,
    _serial,
    _foreign_mdev,
    _pci_hostdev,
    _video,
    _misc,
]


def _metadata(rng: random.Random) -> list[str]:
    kind = rng.choice(["none", "none", "empty", "osinfo", "tricky"])
    if kind == "none":
        return []
    if kind == "empty":
        return ["<metadata/>"]
    body = [
        f'  <libosinfo:libosinfo xmlns:libosinfo="{OSINFO_NS}">',
        '    <libosinfo:os id="http://debian.org/debian/12"/>',
        "  </libosinfo:libosinfo>",
    ]
    if kind == "tricky":
        body.append(
            '  <t:notes xmlns:t="http://example.org/t"><!-- kept --><![CDATA[a<b&c]]>'
            "it&apos;s</t:notes>"
        )
    return ["<metadata>", *body, "</metadata>"]


def libvirt_domain(seed: int) -> str:
    """One domain as ``virsh dumpxml`` would print it."""
    rng = random.Random(seed)
    machine = rng.choice(["pc-q35-7.2", "pc-i440fx-7.2", "pc-q35-9.0"])
    virt = rng.choice(["kvm", "qemu"])
    qemu_ns = rng.random() < 0.4
    running = rng.random() < 0.3
    head = f"<domain type='{virt}'"
    if running:
        head += f" id='{rng.randrange(1, 99)}'"
    if qemu_ns:
        head += f" xmlns:qemu='{QEMU_NS}'"
    mem = rng.choice([65536, 1048576, 4194304])
    lines = [head + ">", f"  <name>vm{seed}</name>"]
    lines.append(f"  <uuid>{uuid.UUID(int=rng.getrandbits(128), version=4)}</uuid>")
    if rng.random() < 0.3:
        lines.append(f"  <title>{_esc('Seed ' + str(seed) + ' <test>')}</title>")
    if rng.random() < 0.4:
        lines.append(f"  <description>{_esc(_DESCRIPTION)}</description>")
    lines += ["  " + x for x in _metadata(rng)]
    lines += [
        f"  <memory unit='KiB'>{mem}</memory>",
        f"  <currentMemory unit='KiB'>{mem}</currentMemory>",
        f"  <vcpu placement='static'>{rng.randrange(1, 5)}</vcpu>",
        "  <os>",
        f"    <type arch='x86_64' machine='{machine}'>hvm</type>",
        "    <boot dev='hd'/>",
        "  </os>",
    ]
    if rng.random() < 0.7:
        lines += ["  <features>", "    <acpi/>", "    <apic/>", "  </features>"]
    if rng.random() < 0.5:
        lines.append("  <cpu mode='host-passthrough' check='none' migratable='on'/>")
    lines += [
        "  <clock offset='utc'/>",
        "  <on_poweroff>destroy</on_poweroff>",
        "  <on_reboot>restart</on_reboot>",
        "  <on_crash>destroy</on_crash>",
        "  <devices>",
    ]
    if rng.random() < 0.7:
        lines.append("    <emulator>/usr/bin/qemu-system-x86_64</emulator>")
        slots = _Slots(machine)
        for i in range(rng.randrange(0, 7)):
            kind = rng.choice(_DEVICE_KINDS)
            lines += ["    " + x for x in kind(rng, i, slots)]
    lines.append("  </devices>")
    if rng.random() < 0.3:
        lines.append("  <seclabel type='dynamic' model='dac' relabel='yes'/>")
    if qemu_ns:
        lines += ["  <qemu:commandline>", "    <qemu:arg value='-s'/>", "  </qemu:commandline>"]
    lines.append("</domain>")
    return "\n".join(lines) + "\n"


# -- hand edits of libvirt's output --------------------------------------------------------
def _crlf(text: str, rng: random.Random) -> str:
    return text.replace("\n", "\r\n")


def _comments(text: str, rng: random.Random) -> str:
    text = text.replace("  <memory ", "  <!-- sized for the demo -->\n  <memory ", 1)
    return "<?xml version='1.0' encoding='UTF-8'?>\n<!-- exported -->\n" + text + "<!-- end -->\n"


def _cdata(text: str, rng: random.Random) -> str:
    return (
        text.replace(
            "<on_crash>", '<description><![CDATA[x < y && "z"]]></description>\n  <on_crash>', 1
        )
        if "<description>" not in text
        else text
    )


def _spaced_empty(text: str, rng: random.Random) -> str:
    return text.replace("'/>", "' />")


def _double_quotes(text: str, rng: random.Random) -> str:
    # As other tools write XML; libvirt's values never hold a raw quote of either kind.
    return _SINGLE_QUOTED.sub(r'\1="\2"', text)


def _four_spaces(text: str, rng: random.Random) -> str:
    return "\n".join(
        " " * (2 * (len(line) - len(line.lstrip(" ")))) + line.lstrip(" ")
        for line in text.split("\n")
    )


def _devices_elsewise(text: str, rng: random.Random) -> str:
    if "<emulator>" in text:
        return text
    return text.replace("  <devices>\n  </devices>\n", rng.choice(["", "  <devices/>\n"]))


def _no_final_newline(text: str, rng: random.Random) -> str:
    return text.rstrip("\n")


EDITS: dict[str, Callable[[str, random.Random], str]] = {
    "crlf": _crlf,
    "comments": _comments,
    "cdata": _cdata,
    "spaced-empty": _spaced_empty,
    "double-quotes": _double_quotes,
    "four-spaces": _four_spaces,
    "devices-elsewise": _devices_elsewise,
    "no-final-newline": _no_final_newline,
}


@dataclass(frozen=True)
class CorpusDocument:
    name: str
    data: bytes
    libvirt_written: bool  # no hand edits: exactly what virsh dumpxml prints


def corpus(count: int, *, first_seed: int = 0) -> Iterator[CorpusDocument]:
    """``count`` documents: every third as libvirt writes it, the others with 1-3 hand edits
    (applied in a fixed order, so CRLF comes after the edits that insert lines)."""
    names = list(EDITS)
    for seed in range(first_seed, first_seed + count):
        text = libvirt_domain(seed)
        rng = random.Random(seed * 7919)
        chosen: list[str] = []
        if seed % 3:
            chosen = sorted(rng.sample(names, rng.randrange(1, 4)), key=names.index)
        # CRLF last: the other edits work on LF text.
        for name in sorted(chosen, key=lambda n: n == "crlf"):
            text = EDITS[name](text, rng)
        yield CorpusDocument(
            name=f"seed{seed}" + "".join(f"+{n}" for n in chosen),
            data=text.encode(),
            libvirt_written=not chosen,
        )
