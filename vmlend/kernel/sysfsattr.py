"""Reading one sysfs attribute as the kernel writes it, and nothing else.

A kernel attribute is a regular file of at most one page of ASCII text, usually one value and
a newline. vmlend trusts the driver behind it, but a broken or foreign driver, a damaged fake
root or a stray file must not become a traceback or a silently wrong number: everything else
(a directory, a FIFO, a symbolic link loop, other bytes, a number out of the attribute's
range) is a ``SysfsAttributeError`` naming the path. A missing file stays
``FileNotFoundError``, because callers tell "the device went away" from "the attribute is
missing" by looking at the directory again.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path

from vmlend.errors import SysfsAttributeError

#: The kernel's ``show()`` fills one page: no attribute is longer.
MAX_ATTRIBUTE_BYTES = 4096
#: How the kernel prints numbers: decimal or ``0x`` hex (``%d``, ``%#x``), optionally negative.
_NUMBER_RE = re.compile(r"-?(?:0[xX][0-9a-fA-F]+|[0-9]+)")


def _shown(text: str) -> str:
    """``text`` for a message: quoted, and short even when the attribute is a page long."""
    return repr(text if len(text) <= 40 else text[:40] + "...")


def read_text(path: Path, check: str = "its driver ('dmesg')") -> str:
    """The attribute's text (every line, trailing newline removed)."""
    try:
        # O_NONBLOCK: a FIFO planted where an attribute belongs must not block the reader.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SysfsAttributeError(path, _open_problem(e), check) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise SysfsAttributeError(path, "a directory where the kernel puts a file", check)
        if not stat.S_ISREG(mode):
            raise SysfsAttributeError(path, "not a regular file (a FIFO, socket or device)", check)
        try:
            data = os.read(fd, MAX_ATTRIBUTE_BYTES + 1)
        except OSError as e:
            raise SysfsAttributeError(path, f"cannot be read: {e.strerror}", check) from None
    finally:
        os.close(fd)
    if len(data) > MAX_ATTRIBUTE_BYTES:
        raise SysfsAttributeError(
            path, f"longer than {MAX_ATTRIBUTE_BYTES} bytes, the most an attribute holds", check
        )
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise SysfsAttributeError(path, f"not ASCII text: {data[:40]!r}", check) from None
    if not all(c.isprintable() or c == "\n" for c in text):
        raise SysfsAttributeError(path, f"holds control characters: {_shown(text)}", check)
    return text.rstrip("\n")


def _open_problem(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "a symbolic link loop"
    if e.errno == errno.ENOTDIR:
        return "its directory is a file"
    return f"cannot be opened: {e.strerror}"


def is_directory(path: Path, check: str = "its driver ('dmesg')") -> bool:
    """Whether the kernel's directory ``path`` is there: False when it is not (it may have
    gone), ``SysfsAttributeError`` when something else stands in its place (a loop, a file)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as e:
        raise SysfsAttributeError(path, _open_problem(e), check) from None
    if not stat.S_ISDIR(mode):
        raise SysfsAttributeError(path, "a file where the kernel puts a directory", check)
    return True


def read_value(path: Path, check: str = "its driver ('dmesg')") -> str:
    """A one-value attribute: its text stripped of surrounding blanks, on one line."""
    text = read_text(path, check).strip()
    if "\n" in text:
        raise SysfsAttributeError(path, f"expected one line, got {_shown(text)}", check)
    return text


def parse_number(
    path: Path, text: str, lo: int, hi: int, what: str, check: str = "its driver ('dmesg')"
) -> int:
    """``text`` as the kernel prints a number, within ``lo..hi`` (the attribute's width)."""
    if not _NUMBER_RE.fullmatch(text):
        raise SysfsAttributeError(path, f"expected {what}, got {_shown(text)}", check)
    neg = text.startswith("-")
    digits = text[1:] if neg else text
    value = int(digits, 16) if digits[:2] in ("0x", "0X") else int(digits, 10)
    value = -value if neg else value
    if not lo <= value <= hi:
        raise SysfsAttributeError(
            path, f"{what} must be between {_num(lo)} and {_num(hi)}, got {_shown(text)}", check
        )
    return value


def _num(n: int) -> str:
    return f"{n:#x}" if abs(n) > 0xFFFF else str(n)


def read_number(
    path: Path, lo: int, hi: int, what: str, check: str = "its driver ('dmesg')"
) -> int:
    return parse_number(path, read_value(path, check), lo, hi, what, check)
