"""The host's notes of the children it made: only vmlend's own notes, in a directory only this
user may write, are read back."""

from __future__ import annotations

import os

import msgspec
import pytest

from vmlend.errors import UnsafePathError
from vmlend.kernel.made_mdevs import MadeMdev, MadeMdevs
from vmlend.topology.model import GuestRam, GuestRange

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002"


def made(uuid: str = U1, vm: str = "web") -> MadeMdev:
    return MadeMdev(uuid, 0x12, "smartio-12", "smartio-lend", "gamma", vm)


def test_noted_then_forgotten(tmp_path):
    notes = MadeMdevs(tmp_path / "made-mdevs")
    assert notes.all() == []
    notes.forget(U1)  # nothing noted yet: nothing to do
    notes.note(made(U1))
    notes.note(made(U2, "db"))
    notes.note(made(U1))  # again: the same one note
    assert notes.all() == [made(U1), made(U2, "db")]
    assert (tmp_path / "made-mdevs").stat().st_mode & 0o777 == 0o700
    notes.forget(U1)
    assert notes.all() == [made(U2, "db")]
    assert made(U2, "db").info().vm == "db"


def test_what_is_not_a_note_is_skipped(tmp_path, caplog):
    notes = MadeMdevs(tmp_path / "made-mdevs")
    notes.note(made(U1))
    d = notes.dir
    (d / "garbage.json").write_text("{not json")
    (d / f"{U2}.json").write_bytes((d / f"{U1}.json").read_bytes())  # names another mdev
    os.symlink(d / f"{U1}.json", d / "link.json")
    os.mkfifo(d / "fifo.json")  # would block a reader that waited for a writer
    (d / "big.json").write_bytes(b" " * 20000)
    (d / "README").write_text("not an entry's name")
    assert notes.all() == [made(U1)]
    for name in ("garbage.json", f"{U2}.json", "link.json", "fifo.json", "big.json"):
        assert f"made-mdevs/{name}" in caplog.text


def test_a_directory_others_may_write_gives_no_notes_and_takes_none(tmp_path, caplog):
    notes = MadeMdevs(tmp_path / "made-mdevs")
    notes.note(made(U1))
    os.chmod(notes.dir, 0o775)
    assert notes.all() == []
    assert "another user owns it or may write to it" in caplog.text
    with pytest.raises(UnsafePathError):
        notes.note(made(U2))


def test_a_link_in_place_of_the_directory_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", tmp_path / "made-mdevs")
    notes = MadeMdevs(tmp_path / "made-mdevs")
    with pytest.raises(UnsafePathError):
        notes.note(made(U1))
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_note_keeps_the_guests_ram_and_an_older_note_reads_without(tmp_path):
    notes = MadeMdevs(tmp_path / "made-mdevs")
    # the most ranges a driver takes, at the highest addresses: still one note
    ram = GuestRam(tuple(GuestRange((1 << 51) + i * 0x2000, (1 << 51) + i * 0x2000 + 0x1000)
                         for i in range(64)))  # fmt: skip
    with_ram = msgspec.structs.replace(made(U1), ram=ram)
    notes.note(with_ram)
    assert notes.get(U1) == with_ram and notes.all() == [with_ram]
    # a note written before the field existed
    old = b'{"uuid":"%s","fdid":18,"parent":"smartio-12","type_id":"smartio-lend",' % U2.encode()
    (notes.dir / f"{U2}.json").write_bytes(old + b'"node":"gamma","vm":"db"}')
    assert notes.get(U2) == made(U2, "db") and notes.get(U2).ram is None
    assert notes.get("83b8f4f2-509f-382f-3c1e-e6bfe0fa1003") is None
