"""The system log: journald's native protocol (and syslog where there is no journald), the VM
and device as fields, the host's socket found under the root, and nothing raised when the
logger is gone."""

from __future__ import annotations

import logging
import socket
import struct

from vmlend.journal import (
    JournalSink,
    SyslogSink,
    SystemLogHandler,
    encode_entry,
    field_value,
    log_fields,
    open_system_log,
)


def _listen(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(2)
    return s


def decode_entry(data: bytes) -> dict[str, str]:
    """journald's parser, for what this test needs: lines, and length-prefixed values."""
    out, i = {}, 0
    while i < len(data):
        end = data.index(b"\n", i)
        line = data[i:end]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            out[key.decode()] = value.decode()
            i = end + 1
        else:
            (size,) = struct.unpack("<Q", data[end + 1 : end + 9])
            out[line.decode()] = data[end + 9 : end + 9 + size].decode()
            i = end + 9 + size + 1
    return out


def test_an_entry_with_a_newline_is_length_prefixed_and_reads_back():
    entry = {"MESSAGE": "two\nlines", "PRIORITY": "4", "VMLEND_VM": "web"}
    assert decode_entry(encode_entry(entry)) == entry
    assert b"MESSAGE\n" + struct.pack("<Q", 9) + b"two\nlines\n" in encode_entry(entry)


def test_a_logged_line_carries_the_vm_and_device_as_fields(tmp_path):
    with _listen(tmp_path / "journal") as s:
        log = logging.getLogger("vmlend.test.journal")
        handler = SystemLogHandler(JournalSink(str(tmp_path / "journal"), "vmlend-agent"))
        log.addHandler(handler)
        try:
            with log_fields(vm="web"), log_fields(fdid="0x10"):
                log.warning("paused %s", "web")
            log.error("took back", extra={"fdid": "0x20", "vm": "db"})
        finally:
            log.removeHandler(handler)
        first, second = (decode_entry(s.recv(65536)) for _ in range(2))
    assert first["MESSAGE"] == "paused web" and first["PRIORITY"] == "4"
    assert (first["VMLEND_VM"], first["VMLEND_FDID"]) == ("web", "0x10")
    assert first["SYSLOG_IDENTIFIER"] == "vmlend-agent"
    assert (second["VMLEND_VM"], second["VMLEND_FDID"], second["PRIORITY"]) == ("db", "0x20", "3")


def test_syslog_gets_a_tagged_line_with_the_fields_as_words(tmp_path):
    with _listen(tmp_path / "log") as s:
        assert SyslogSink(str(tmp_path / "log"), "vmlend-hook").send("started", 20, {"vm": "web"})
        line = s.recv(4096).decode()
    assert line.startswith("<30>vmlend-hook[") and line.endswith("]: started vm=web")


def test_the_hosts_journal_wins_over_syslog_and_the_variable_over_both(tmp_path):
    root = tmp_path / "root"
    assert open_system_log(root, "x", {}) is None  # neither: stderr only
    (root / "dev").mkdir(parents=True)
    with _listen(root / "dev" / "log"):
        assert isinstance(open_system_log(root, "x", {}), SyslogSink)
        (root / "run" / "systemd" / "journal").mkdir(parents=True)
        with _listen(root / "run" / "systemd" / "journal" / "socket"):
            sink = open_system_log(root, "x", {})
            assert isinstance(sink, JournalSink) and sink.address.endswith("journal/socket")
            named = open_system_log(root, "x", {"VMLEND_LOG_SOCKET": str(tmp_path / "t")})
            assert isinstance(named, JournalSink) and named.address == str(tmp_path / "t")


def test_a_logger_gone_costs_nothing_and_raises_nothing(tmp_path):
    sink = JournalSink(str(tmp_path / "nobody"), "x")
    assert not sink.send("a", 20, {}) and not sink.send("b", 20, {})


def test_a_value_cannot_forge_a_syslog_line_or_a_field(tmp_path):
    name = 'web vm=db "x\\" fdid=0x10\n<27>vmlend-hook[1]: forged'
    with _listen(tmp_path / "log") as s:
        SyslogSink(str(tmp_path / "log"), "vmlend-hook").send(f"{name} started", 20, {"vm": name})
        line = s.recv(4096).decode()
    assert "\n" not in line
    assert line.endswith(
        ' forged started vm="web vm=db \\"x\\\\\\" fdid=0x10\\n<27>vmlend-hook[1]: forged"'
    ), line
    assert field_value("web") == "web" and field_value("") == '""'
    assert field_value("a\u2028b") == '"a\\u2028b"' and field_value("a=b") == '"a=b"'


def test_escape_sequences_never_reach_journald(tmp_path):
    with _listen(tmp_path / "journal") as s:
        sink = JournalSink(str(tmp_path / "journal"), "vmlend-hook")
        sink.send("vm \x1b[2J\x1b]0;owned\x07 paused\nforged", 40, {"vm": "\x1b[31mweb"})
        data = s.recv(65536)
    assert b"\x1b" not in data and b"\x07" not in data
    entry = decode_entry(data)
    assert entry["MESSAGE"] == "vm \\x1b[2J\\x1b]0;owned\\x07 paused\\nforged"
    assert entry["VMLEND_VM"] == "\\x1b[31mweb"
