"""The hook's action log gets the records of its own call only: in ``vmlend agent``, which
runs hook calls on a worker thread of a long-running process, other threads' records must not
land in a domain's log, and no handler may outlive its call."""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
import uuid
from xml.sax.saxutils import escape

from tests.support.simfabric import make_fabric
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.hook.actionlog import ActionLog
from vmlend.hook.loghandler import ActionLogHandler
from vmlend.hook.main import run
from vmlend.topology.model import MiB
from vmlend.wiring.fabric import open_fabric


def vm_xml() -> bytes:
    spec = DomainSpec(
        name="vm1",
        memory_bytes=512 * MiB,
        uuid=uuid.UUID("6f1c5a2e-0000-4000-8000-00000000000b"),
        devices=[DeviceRequest(f) for f in (0x10, 0x12, 0x21, 0x22)],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def test_other_threads_log_records_never_reach_a_domains_action_log(state_path):
    make_fabric(state_path).close()
    stop = threading.Event()

    def agent_thread() -> None:  # another thread of a long-running process, logging away
        while not stop.is_set():
            logging.getLogger("vmlend.agent.service").warning("agent-thread-line")
            time.sleep(0.001)

    other = threading.Thread(target=agent_thread)
    other.start()
    try:
        for op, sub in (("prepare", "begin"), ("release", "end")):
            code = run(
                ["vm1", op, sub, "-"],
                stdin=io.BytesIO(vm_xml()),
                stdout=io.BytesIO(),
                stderr=io.StringIO(),
                environ={"VMLEND_STATE": str(state_path), "VMLEND_NODE": "gamma"},
            )
            assert code == 0
    finally:
        stop.set()
        other.join()
    logging.getLogger("vmlend.agent.service").warning("agent-thread-line after the calls")
    text = (state_path.parent / "hook.log").read_text()
    assert "prepare: 4 devices ready" in text and "agent-thread-line" not in text
    root = logging.getLogger()
    assert not [h for h in root.handlers if isinstance(h, ActionLogHandler)]  # no leak


def test_a_library_warning_of_the_call_itself_still_reaches_its_action_log(state_path):
    make_fabric(state_path).close()

    def warning_fabric(location, node):
        logging.getLogger("vmlend.fabric").warning("warned while opening the fabric")
        return open_fabric(location, node)

    code = run(
        ["vm1", "release", "end", "-"],
        stdin=io.BytesIO(vm_xml()),
        stdout=io.BytesIO(),
        stderr=io.StringIO(),
        environ={"VMLEND_STATE": str(state_path)},
        open_fabric=warning_fabric,
    )
    assert code == 0
    text = (state_path.parent / "hook.log").read_text()
    assert "vm=vm1 warning: warned while opening the fabric" in text


def test_a_newline_in_a_domain_name_cannot_forge_a_log_line(state_path):
    """A (simulated) domain's name holding a newline and a fake entry stays on its own line of
    the hook's log, escaped."""
    make_fabric(state_path).close()
    forged = "vm1\n2026-01-01T00:00:00Z pid=1 vm=vm2 release: released 0x10"
    xml = vm_xml().replace(b"<name>vm1</name>", f"<name>{forged}</name>".encode())
    assert forged.encode() in xml
    for op, sub in (("prepare", "begin"), ("release", "end")):
        run(
            [forged, op, sub, "-"],
            stdin=io.BytesIO(xml),
            stdout=io.BytesIO(),
            stderr=io.StringIO(),
            environ={"VMLEND_STATE": str(state_path), "VMLEND_NODE": "gamma"},
        )
    lines = (state_path.parent / "hook.log").read_text().splitlines()
    assert len(lines) > 2 and all(line.startswith("20") for line in lines)
    quoted = ' vm="vm1\\n2026-01-01T00:00:00Z pid=1 vm=vm2 release: released 0x10" '
    assert all(quoted in line for line in lines)
    assert not any(line.startswith("2026-01-01T00:00:00Z") for line in lines)


def _entries(sock: socket.socket) -> list[dict[str, str]]:
    out = []
    while True:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return out
        out.append(dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line))


def test_each_action_also_reaches_the_system_log_with_its_vm_and_device(state_path, tmp_path):
    make_fabric(state_path).close()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "journal"))
        sock.settimeout(0.5)
        code = run(
            ["vm1", "prepare", "begin", "-"],
            stdin=io.BytesIO(vm_xml()),
            stdout=io.BytesIO(),
            stderr=io.StringIO(),
            environ={
                "VMLEND_STATE": str(state_path),
                "VMLEND_NODE": "gamma",
                "VMLEND_LOG_SOCKET": str(tmp_path / "journal"),
            },
        )
        assert code == 0
        entries = _entries(sock)
    assert entries and {e["SYSLOG_IDENTIFIER"] for e in entries} == {"vmlend-hook"}
    assert {e["VMLEND_VM"] for e in entries} == {"vm1"}
    by_device = {e.get("VMLEND_FDID") for e in entries if "prepare: reserve" in e["MESSAGE"]}
    assert by_device == {"0x10", "0x12", "0x21", "0x22"}
    assert any(e["MESSAGE"] == "vm1 prepare: 4 devices ready" for e in entries)


def syslog_words(line: str) -> list[tuple[str, str]]:
    """The ``key=value`` words after a syslog line's message, a quoted value read back."""
    import shlex

    return [tuple(w.split("=", 1)) for w in shlex.split(line) if "=" in w]  # type: ignore[misc]


def test_a_vm_name_cannot_forge_a_syslog_line_or_field(state_path, tmp_path, monkeypatch):
    """On a host without journald the hook logs to syslog's /dev/log: a name with a newline, a
    space and 'vm=' stays inside its one quoted field of one line (a terminal escape, which no
    XML name can hold, is escaped by the sinks: tests/unit/core/test_journal.py)."""
    make_fabric(state_path).close()
    root = tmp_path / "root"
    (root / "dev").mkdir(parents=True)
    name = "vm1 vm=vm2 fdid=0x99\n<27>vmlend-hook[1]: vm2 release: FAILED"
    xml = vm_xml().replace(b"<name>vm1</name>", f"<name>{escape(name)}</name>".encode())
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(root / "dev" / "log"))
        sock.settimeout(0.5)
        code = run(
            [name, "prepare", "begin", "-"],
            stdin=io.BytesIO(xml),
            stdout=io.BytesIO(),
            stderr=io.StringIO(),
            environ={
                "VMLEND_STATE": str(state_path),
                "VMLEND_NODE": "gamma",
                "VMLEND_ROOT": str(root),
            },
        )
        assert code == 0
        lines = []
        while True:
            try:
                lines.append(sock.recv(65536).decode())
            except TimeoutError:
                break
    assert lines
    for line in lines:
        assert "\n" not in line and "\x1b" not in line, line
        assert line.startswith("<30>vmlend-hook[") or line.startswith("<27>vmlend-hook[")
        words = syslog_words(line.split("]: ", 1)[1])
        vms = [v for k, v in words if k == "vm"]
        assert vms == [name.replace("\n", "\\n")], line


def test_the_action_log_rotates_at_its_cap_and_reads_across(tmp_path):
    log = ActionLog(tmp_path / "hook.log", max_bytes=400)
    for i in range(30):
        log.record("vm1", "prepare", f"line {i}")
    assert (tmp_path / "hook.log.1").exists()
    assert (tmp_path / "hook.log").stat().st_size <= 400 + 200  # one line past the cap at most
    assert not (tmp_path / "hook.log.2").exists()  # one old file kept
    tail = log.tail(5)
    assert [t.rsplit(" ", 1)[1] for t in tail] == ["25", "26", "27", "28", "29"]
    total = sum(1 for p in tmp_path.glob("hook.log*") for _ in p.open())
    assert len(log.tail(1000)) == total < 30  # the oldest went with the rotation
