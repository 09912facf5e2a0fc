"""Support for tests/scenarios/test_fuzz_boundaries.py: hypothesis settings, the one property every
boundary shares, state snapshots, and the mutators that turn a valid input (a domain XML, the
default topology) into a hostile one.

Mutations are plans of small steps (``(op, position, value)``) that hypothesis draws and
shrinks; applying a plan is deterministic, so a failure shrinks to the fewest steps that
still break vmlend and prints them.
"""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from lxml import etree

from tests.support.hypothesis_tiers import examples

#: Examples per boundary in ``make test``; ``VMLEND_FUZZ_EXAMPLES`` explores more (the long
#: profile, e.g. 2000). ``make test-fast`` runs its share (tests/support/hypothesis_tiers.py).
EXAMPLES = int(os.environ.get("VMLEND_FUZZ_EXAMPLES", "100"))


def fuzz_settings(scale: float = 1.0) -> settings:
    """Deterministic in CI (the same examples every run, no example database), no deadline
    (timing would make it flaky on a shared machine)."""
    return settings(
        max_examples=examples(max(1, int(EXAMPLES * scale))),
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


# --- the property -----------------------------------------------------------------------------


def assert_clean_failure(code: int, stderr: str, ok: tuple[int, ...] = (0,)) -> None:
    """Exit ``ok``, or 1 or 2 with the error on one line: no traceback, no internal error.
    A usage error (2) is click's usage block whose message is its one ``Error:`` line."""
    assert "Traceback" not in stderr, stderr
    # vmlend's marker for a bug; libvirt's own reasons may say "internal error" themselves.
    assert "vmlend: internal error" not in stderr, stderr
    if code in ok:
        return
    assert code in (1, 2), (code, stderr)
    lines = stderr.splitlines()
    if code == 2 and lines and lines[0].startswith("Usage:"):
        lines = [x for x in lines if x.startswith("Error:")]
    assert len(lines) == 1, stderr


def assert_cli_result(result, ok: tuple[int, ...] = (0,)) -> None:  # click.testing.Result
    """``assert_clean_failure`` for a ``CliRunner`` result: an exception other than the
    ``SystemExit`` click ends with is a traceback in a real run."""
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), repr(exc)
    assert_clean_failure(result.exit_code, result.stderr, ok)


def dump_state(path: Path) -> list[str]:
    """Every row of the SQLite state, as SQL: "unchanged" means exactly this, but for the
    fencing-token counter, which only ever grows (a refused prepare's undone hold still
    used a token, so no later hold reuses it)."""
    if not path.exists():
        return []
    con = sqlite3.connect(path)
    try:
        return [row for row in con.iterdump() if "'hold_token'" not in row]
    finally:
        con.close()


def copy_state(src: Path, dst: Path) -> None:
    """``dst`` becomes a copy of the state at ``src`` (through SQLite: the WAL comes along)."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{dst}{suffix}").unlink(missing_ok=True)
    a, b = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        a.backup(b)
    finally:
        a.close()
        b.close()


# --- hostile values -------------------------------------------------------------------------

#: Values a hostile or careless writer puts where a number, a name, a UUID or a unit belongs.
NASTY = (
    "",
    " ",
    "0",
    "-1",
    "0x",
    "0x10",
    "16",
    "0x100000000",
    str(1 << 64),
    str(1 << 160),
    "1e400",
    "nan",
    "inf",
    "-0",
    "0b10000",
    "1_6",
    "\u0661\u0666",  # Arabic-Indic digits
    " 0x10 ",
    "abc",
    "vm1",
    "gamma",
    "../../etc/passwd",
    "a\nb",
    "6f1c5a2e-0000-4000-8000-00000000000",
    "6f1c5a2e-0000-4000-8000-0000000000010",
    "zzzzzzzz-0000-4000-8000-000000000001",
    "00000000-0000-0000-0000-000000000000",
    "KiB",
    "MiB",
    "GiB",
    "TiB",
    "PiB",
    "EiB",
    "b",
    "furlongs",
    "x" * 300,
    "\u202e",
    "9" * 40,
)
nasty_text = st.one_of(
    st.sampled_from(NASTY), st.text(max_size=12), st.integers(-(1 << 70), 1 << 70).map(str)
)


# --- domain XML -----------------------------------------------------------------------------

XML_OPS = ("drop", "dup", "drop-attr", "set-attr", "set-text", "unit", "rename")
xml_plan = st.lists(
    st.tuples(st.sampled_from(XML_OPS), st.integers(0, 10_000), nasty_text), min_size=1, max_size=4
)
#: Byte-level damage after the tree edits: none, cut short, bytes that are not UTF-8.
BYTE_OPS = ("none", "truncate", "latin1", "bad-utf8", "bom", "doctype")
byte_op = st.tuples(st.sampled_from(BYTE_OPS), st.integers(0, 10_000))


def _xml_safe(value: str) -> str:
    """lxml refuses characters XML cannot carry; keep the rest of the hostile value."""
    return "".join(
        c for c in value if c in "\t\n\r" or (0x20 <= ord(c) < 0xD800) or 0xE000 <= ord(c) < 0xFFFE
    )


def mutate_xml(xml: bytes, plan: list[tuple[str, int, str]], tail: tuple[str, int]) -> bytes:
    root = etree.fromstring(xml)
    for op, pos, value in plan:
        elements = list(root.iter())
        el = elements[pos % len(elements)]
        value = _xml_safe(value)
        if op == "drop" and el is not root:
            el.getparent().remove(el)
        elif op == "dup" and el is not root:
            el.addnext(etree.fromstring(etree.tostring(el)))
        elif op == "drop-attr" and el.attrib:
            del el.attrib[sorted(el.attrib)[pos % len(el.attrib)]]
        elif op == "set-attr":
            names = sorted(el.attrib) or ["fdid"]
            el.set(names[pos % len(names)], value)
        elif op == "set-text":
            el.text = value
        elif op == "unit":
            el.set("unit", value)
        elif op == "rename" and el is not root and isinstance(el.tag, str):
            q = etree.QName(el)
            el.tag = etree.QName(q.namespace, "x" + q.localname).text if q.namespace else "x"
    out = etree.tostring(root)
    kind, pos = tail
    if kind == "truncate":
        out = out[: pos % (len(out) + 1)]
    elif kind == "latin1":
        out = out.replace(b"<name>", b"<name>\xe9", 1)
    elif kind == "bad-utf8":
        at = pos % (len(out) + 1)
        out = out[:at] + b"\xff\xfe\xc0" + out[at:]
    elif kind == "bom":
        out = b"\xef\xbb\xbf" + out
    elif kind == "doctype":
        out = b'<!DOCTYPE d [<!ENTITY e SYSTEM "file:///nonexistent">]>' + out
    return out


# --- topology TOML --------------------------------------------------------------------------

TOML_OPS = ("drop", "dup", "value", "number", "number", "insert", "swap", "bytes")
#: Numbers near the edges a topology's fields have, for the "number" step: mostly accepted,
#: so what is taken gets used by the commands after ``fabric init``.
TOML_NUMBERS = (
    "0", "1", "2", "3", "-1", "4", "15", "16", "31", "32", "33", "63", "64", "65", "4096",
    "65535", "65536", "0x7fffffff", "0xffffffff", "0x100000000", str(1 << 52),
    str((1 << 52) + 1), '"4KiB"', '"1MiB"', '"4095B"', '"4096TiB"', '"8192TiB"', '"0B"',
)  # fmt: skip
#: What can stand right of ``=`` in TOML, beyond NASTY as strings.
TOML_VALUES = (
    "0",
    "-1",
    str(1 << 63),
    "1e400",
    "nan",
    "inf",
    "true",
    '""',
    '"16MiB"',
    '"1"',
    '"2^70"',
    f'"{1 << 70}"',
    '"0x10"',
    "[]",
    "[1, 2]",
    "{}",
    "{ index = 9 }",
    "1979-05-27",
    "07:32:00",
    "0x100000000",
    '"alpha"',
    '"gamma:0"',
    '"sw1"',
    "[" * 40 + "]" * 40,
)
toml_plan = st.lists(
    st.tuples(
        st.sampled_from(TOML_OPS),
        st.integers(0, 10_000),
        st.one_of(st.sampled_from(TOML_VALUES), nasty_text.map(repr)),
    ),
    min_size=1,
    max_size=4,
)


# ``key = 12``, ``key = 0x10``, ``key = "16MiB"``; also inside inline tables.
_NUMERIC = re.compile(r'(\b[a-z_]+\s*=\s*)("\d+[KMGT]?i?B"|0x[0-9a-fA-F]+|-?\d+)')


def mutate_toml(text: str, plan: list[tuple[str, int, str]]) -> bytes:
    lines = text.splitlines()
    raw = b""
    for op, pos, value in plan:
        i = pos % len(lines)
        if op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "value" and "=" in lines[i]:
            lines[i] = lines[i].split("=", 1)[0] + "= " + value
        elif op == "number":
            numeric = [k for k, line in enumerate(lines) if _NUMERIC.search(line)]
            if numeric:
                k = numeric[pos % len(numeric)]
                number = TOML_NUMBERS[(pos // len(numeric)) % len(TOML_NUMBERS)]
                lines[k] = _NUMERIC.sub(lambda m, n=number: m.group(1) + n, lines[k], count=1)
        elif op == "insert":
            lines.insert(i, f"{value.strip(chr(39))} = {value}")
        elif op == "swap":
            j = (pos // 7) % len(lines)
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "bytes":
            raw = b"\xff\xfe" if pos % 2 else b"\x00"
        if not lines:
            lines = [""]
    return "\n".join(lines).encode("utf-8", "surrogatepass") + raw


# --- the configuration file -----------------------------------------------------------------

#: An operator's file as docs/user-guide.md shows it, paths as seen inside the host root.
BASE_CONFIG = """\
# the operator's own words
state = "/var/lib/vmlend/state.db"     # --state
node = "gamma"                          # this host
backend = "sim"
hook-socket = "/run/vmlend/hook.sock"
verbose = 1

[agent]
ttl = 10
interval = 0.5

[hook.install]
libvirt-dir = "/etc/libvirt"

[alias]
a100 = { vendor = "10de", product = "20b0" }
"""
#: What a careless or hostile writer puts right of ``=`` in it, beyond TOML_VALUES.
CONFIG_VALUES = (
    '"/../../../etc/shadow"',
    '"rel/state.db"',
    '"sqlite:///var/lib/vmlend/other.db"',
    '"sqlite://rel.db"',
    '"etcd://127.0.0.1:1/c?cacert=/ca.pem"',
    '["/a"]',
    '"/a\\nb"',
    '"/a\\u2028b"',
    "5",
    "true",
    "0.5",
    "[" * 3000 + "]" * 3000,
    "{ a = " * 300 + "1" + " }" * 300,
)
#: Characters that end a line for ``str.splitlines`` but not for TOML.
LINE_ENDS = ("\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\r")
#: What stands at the file's path: the file, or something that is none.
CONFIG_KINDS = ("file",) * 6 + ("fifo", "directory", "missing", "loop", "huge")

config_plan = st.lists(
    st.tuples(
        st.sampled_from((*TOML_OPS, "comment", "comment")),
        st.integers(0, 10_000),
        st.one_of(
            st.sampled_from(CONFIG_VALUES + TOML_VALUES), nasty_text.map(repr)
        ),
    ),
    min_size=0,
    max_size=4,
)


def mutate_config(plan: list[tuple[str, int, str]]) -> bytes:
    """``BASE_CONFIG`` changed by ``plan``: ``mutate_toml``'s steps, and "comment", a comment
    ending in a character only ``str.splitlines`` takes for a line end, a key after it."""
    out, raw = BASE_CONFIG, b""
    for op, pos, value in plan:
        if op == "bytes":
            raw = b"\xff\xfe" if pos % 2 else b"\x00"
        elif op == "comment":
            lines = out.split("\n")  # TOML's line ends, not str.splitlines
            end = LINE_ENDS[pos % len(LINE_ENDS)]
            key = ("state", "node", "registry", "backend", "hook-socket")[pos % 5]
            lines.insert(pos % len(lines), f"# a comment{end}{key} = {value}")
            out = "\n".join(lines)
        else:
            out = mutate_toml(out, [(op, pos, value)]).decode("utf-8", "surrogatepass")
    return out.encode("utf-8", "surrogatepass") + raw
