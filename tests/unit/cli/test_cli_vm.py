"""``vmlend vm``: virsh's lifecycle commands on simulated nodes, the global -c, wait progress,
and the README tour's commands as a user types them."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import threading
import time

from tests.support.cli_cluster import metadata_fdids, one_line
from vmlend import safefile
from vmlend.cli.progress import Wait


def _rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()[1:] if line.strip()]


def test_define_start_list_shutdown_undefine(cluster, tmp_path):
    xml = tmp_path / "web.xml"
    r = cluster.cli("xml", "new", "web", "--memory", "256M", "--virt-type", "qemu", "-o", str(xml))
    assert r.exit_code == 0, r.output
    r = cluster.cli("vm", "define", str(xml), "-c", "sim:///gamma")
    assert (r.exit_code, r.stdout) == (0, f"Domain 'web' defined from {xml}\n")
    assert cluster.cli("vm", "list", "-c", "sim:///gamma").stdout.splitlines()[1:] == []
    assert _rows(cluster.cli("vm", "list", "--all", "-c", "sim:///gamma").stdout) == [
        ["web", "shut", "off", "yes"]
    ]
    assert cluster.cli("vm", "start", "web", "-c", "sim:///gamma").exit_code == 0
    assert cluster.cli("vm", "domstate", "web", "-c", "sim:///gamma").stdout == "running\n"
    assert _rows(cluster.cli("vm", "list", "-c", "sim:///gamma").stdout) == [
        ["web", "running", "yes"]
    ]
    r = cluster.cli("vm", "shutdown", "web", "--timeout", "5", "-c", "sim:///gamma")
    assert r.exit_code == 0, r.output
    assert "waiting up to 5 s for domain 'web' to shut down" in r.stderr
    assert cluster.cli("vm", "domstate", "web", "-c", "sim:///gamma").stdout == "shut off\n"
    dumped = cluster.cli("vm", "dumpxml", "web", "-c", "sim:///gamma").stdout
    assert "<name>web</name>" in dumped
    r = cluster.cli("vm", "undefine", "web", "-c", "sim:///gamma")
    assert r.stdout == "Domain 'web' has been undefined\n"
    assert cluster.cli("vm", "list", "--all", "-c", "sim:///gamma").stdout.splitlines()[1:] == []


def test_the_global_connect_option_reaches_every_command(cluster, tmp_path):
    cluster.define("gamma", "g1")
    assert _rows(cluster.cli("-c", "sim:///gamma", "vm", "list", "--all").stdout)[0][0] == "g1"
    assert cluster.cli("-c", "sim:///alpha", "vm", "list", "--all").stdout.splitlines()[1:] == []
    # A command's own -c wins over the global one.
    r = cluster.cli("-c", "sim:///alpha", "vm", "list", "--all", "-c", "sim:///gamma")
    assert _rows(r.stdout)[0][0] == "g1"
    assert cluster.cli("-c", "sim:///gamma", "status", "g1").exit_code == 0


def test_bad_input_is_one_line(cluster, tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<domain><name>x</name>")
    assert "not well-formed" in one_line(
        cluster.cli("vm", "define", str(bad), "-c", "sim:///gamma")
    )
    assert "ghost" in one_line(cluster.cli("vm", "start", "ghost", "-c", "sim:///gamma"))
    assert "ghost" in one_line(cluster.cli("vm", "domstate", "ghost", "-c", "sim:///gamma"))
    # Found by tests/scenarios/test_fuzz_boundaries.py: no "waiting up to ..." line before
    # the error.
    assert "ghost" in one_line(cluster.cli("vm", "shutdown", "ghost", "-c", "sim:///gamma"))


def test_a_wait_says_what_it_waits_for_and_shows_a_live_indicator_on_a_tty():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    with Wait("something", 2, stream=stream):
        time.sleep(1.2)
    assert "s / 2 s" in stream.getvalue()  # at least one tick in 1.2 s
    plain = io.StringIO()
    with Wait("something", 2, stream=plain):
        pass
    assert plain.getvalue() == ""  # not a terminal: only the start line (on stderr)


def test_the_readme_tour_runs_as_written(cluster, tmp_path):
    """The README's 'define a VM with a remote device, start it, hot-add, migrate, stop'."""
    xml = tmp_path / "web.xml"
    steps = [
        [
            "xml",
            "new",
            "web",
            "--memory",
            "512M",
            "--virt-type",
            "qemu",
            "--device",
            "0x10",
            "-o",
            str(xml),
        ],
        ["-c", "sim:///gamma", "vm", "define", str(xml)],
        ["-c", "sim:///gamma", "vm", "start", "web"],
        ["-c", "sim:///gamma", "attach", "web", "0x12", "--persistent"],
        ["-c", "sim:///gamma", "status", "web"],
        ["-c", "sim:///gamma", "migrate", "web", "--to", "alpha", "--start"],
        ["-c", "sim:///alpha", "vm", "list"],
        ["-c", "sim:///alpha", "vm", "shutdown", "web"],
        ["-c", "sim:///alpha", "vm", "domstate", "web"],
    ]
    for argv in steps:
        r = cluster.cli(*argv)
        assert r.exit_code == 0, (argv, r.output)
    assert r.stdout == "shut off\n"
    defined = cluster.cli("-c", "sim:///alpha", "vm", "dumpxml", "web", "--inactive").stdout
    assert metadata_fdids(defined.encode()) == ["0x10", "0x12"]
    assert cluster.holds() == {}


def test_the_same_commands_drive_libvirt(cluster, tmp_path):
    """A libvirt URI (the test driver on a checked-in node file; its state lives for one
    connection, so each command starts from the file's state)."""
    from tests.support.domain_support import DATA

    uri = f"test://{DATA / 'test-node.xml'}"
    r = cluster.cli("-c", uri, "vm", "list", "--all")
    assert (r.exit_code, _rows(r.stdout)) == (0, [])
    xml = tmp_path / "t.xml"
    assert cluster.cli("xml", "new", "t", "--device", "0x10", "-o", str(xml)).exit_code == 0
    r = cluster.cli("-c", uri, "vm", "define", str(xml))
    assert (r.exit_code, r.stdout) == (0, f"Domain 't' defined from {xml}\n"), r.output
    assert "ghost" in one_line(cluster.cli("-c", uri, "vm", "start", "ghost"))


def test_inputs_that_would_block_or_grow_are_refused_with_one_line(cluster, tmp_path):
    fifo = tmp_path / "fifo.xml"
    os.mkfifo(fifo)
    # Unfixed, opening the FIFO blocks: a late writer bounds the wait (the reader then gets EOF).
    unblock = threading.Timer(5, _open_and_close_writer, [fifo])
    unblock.start()
    try:
        assert "it is a FIFO, not a regular file" in one_line(cluster.cli("xml", "show", str(fifo)))
        assert "it is a FIFO" in one_line(
            cluster.cli("vm", "define", str(fifo), "-c", "sim:///gamma")
        )
        assert "it is a FIFO" in one_line(cluster.cli("fabric", "init", "--topology", str(fifo)))
    finally:
        unblock.cancel()
    device = tmp_path / "device.xml"  # a null device: the same kind as a zero device
    os.mknod(device, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    assert "it is a character device" in one_line(
        cluster.cli("vm", "define", str(device), "-c", "sim:///gamma")
    )
    huge = tmp_path / "huge.xml"
    with huge.open("wb") as f:
        f.truncate(safefile.MAX_INPUT_BYTES + 1)
    assert "larger than" in one_line(cluster.cli("vm", "define", str(huge), "-c", "sim:///gamma"))
    assert "larger than" in one_line(cluster.cli("xml", "show", str(huge)))
    # a topology file may be larger (a 4,096-node fabric is ~17 MB), up to 64 MiB
    toml = tmp_path / "huge.toml"
    with toml.open("wb") as f:
        f.truncate((64 << 20) + 1)
    assert "larger than 67108864 bytes" in one_line(
        cluster.cli("fabric", "init", "--topology", str(toml))
    )


def _open_and_close_writer(path) -> None:
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def test_a_timeout_that_is_not_a_finite_number_is_refused(cluster):
    def refused(*args: str) -> str:
        r = cluster.cli(*args)
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output
        return r.output

    for value in ("1e400", "inf", "nan"):
        out = refused("vm", "shutdown", "g1", "--timeout", value)
        assert f"'{value}' is not a finite number of seconds" in out
    assert "'1e400' is not a finite" in refused("mdev", "watch", "--timeout", "1e400")
    assert "'nan' is not a finite" in refused("migrate", "g1", "alpha", "--shutdown-timeout", "nan")


def test_a_simulated_node_the_fabric_does_not_have_is_refused_by_every_command(cluster):
    # `vm list` used to list an empty node while `status` refused it
    for args in (("vm", "list"), ("status",), ("vm", "domstate", "web")):
        r = cluster.cli("-c", "sim:///nonexistent", *args)
        assert r.exit_code == 1, (args, r.output)
        assert "unknown node 'nonexistent'" in r.output
        assert len(r.output.strip().splitlines()) == 1


def test_lifecycle_json_says_what_each_command_did(cluster, tmp_path):
    xml = tmp_path / "web.xml"
    r = cluster.cli("xml", "new", "web", "--memory", "256M", "--virt-type", "qemu", "-o", str(xml))
    assert r.exit_code == 0, r.output

    def doc(*args: str) -> dict[str, object]:
        r = cluster.cli("vm", *args, "--json", "-c", "sim:///gamma")
        assert r.exit_code == 0, r.output
        data = json.loads(r.stdout)
        assert data.pop("format") == "vmlend/1"
        return data

    defined = doc("define", str(xml))
    assert (defined["action"], defined["vm"], defined["node"]) == ("defined", "web", "gamma")
    web = {"vm": "web", "node": "gamma"}
    assert doc("start", "web") == {"action": "started", **web}
    assert doc("domstate", "web") == {"uuid": defined["uuid"], "state": "running", **web}
    assert [vm["name"] for vm in doc("list")["vms"]] == ["web"]
    assert doc("shutdown", "web", "--timeout", "5") == {"action": "shut_off", **web}
    assert doc("start", "web")["action"] == "started"
    assert doc("destroy", "web") == {"action": "destroyed", **web}
    assert doc("undefine", "web") == {"action": "undefined", **web}
