"""The fabric, devices, lend/unlend and demo commands, through click's CliRunner."""

from __future__ import annotations

import json
import sqlite3

import pytest
from click.testing import CliRunner

from tests.support.simfabric import small_topology
from vmlend.cli import main
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import open_fabric


@pytest.fixture
def run(state_path, monkeypatch):
    """Invoke ``vmlend`` with a private state path and no node override."""
    monkeypatch.delenv("VMLEND_NODE", raising=False)

    def invoke(*args: str):
        return CliRunner().invoke(main, list(args))

    return invoke


@pytest.fixture
def inited(run, state_path):
    r = run("fabric", "init", "--node", "gamma")
    assert r.exit_code == 0, r.output
    return state_path


def _one_line_error(r, code=1):
    assert r.exit_code == code, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [("fabric", "show"), ("devices",), ("lend", "0x10"), ("unlend", "0x10"), ("devices", "--json")],
)
def test_commands_without_state_say_run_init(run, args):
    line = _one_line_error(run(*args))
    assert "run 'vmlend fabric init' first" in line


def test_init_is_idempotent(run, state_path):
    r = run("fabric", "init", "--node", "gamma")
    assert r.exit_code == 0
    assert r.output.startswith("created:") and "this host is node gamma" in r.output
    r = run("fabric", "init")
    assert r.exit_code == 0 and r.output.startswith("unchanged:")
    r = run("fabric", "init", "--node", "beta", "--json")
    data = json.loads(r.output)
    assert data["action"] == "local node set" and data["local_node"] == "beta"
    assert data["nodes"] == ["alpha", "beta", "gamma"] and data["devices"] == 9


def test_init_default_node_is_the_first_borrower(run):
    r = run("fabric", "init", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["local_node"] == "gamma"  # no hostname matches in tests


def test_init_with_a_topology_file_and_replace(run, inited, tmp_path):
    topo = tmp_path / "small.toml"
    topo.write_text(small_topology())
    line = _one_line_error(run("fabric", "init", "--topology", str(topo)))
    assert "already holds topology 'default'" in line and "--replace" in line
    with open_fabric(inited) as f:
        f.reserve(0x10, Holder("gamma", "vm1"))
    line = _one_line_error(run("fabric", "init", "--topology", str(topo), "--replace"))
    assert "0x10 by gamma/vm1" in line
    with open_fabric(inited) as f:
        f.release(0x10, Holder("gamma", "vm1"))
    r = run("fabric", "init", "--topology", str(topo), "--replace", "--node", "b")
    assert r.exit_code == 0 and r.output.startswith("replaced:"), r.output
    r = run("devices", "--json")
    assert [d["fdid"] for d in json.loads(r.output)["devices"]] == ["0x100", "0x101", "0x102"]


def test_init_bad_input(run, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[[node]]\nname = "a"\nid = "one"\n')
    line = _one_line_error(run("fabric", "init", "--topology", str(bad)))
    assert "bad.toml: node[0] 'a'.id: expected an integer" in line
    syntax = tmp_path / "syntax.toml"
    syntax.write_text("[[node]\n")
    assert "not valid TOML" in _one_line_error(run("fabric", "init", "--topology", str(syntax)))
    missing = tmp_path / "missing.toml"
    assert "cannot read" in _one_line_error(run("fabric", "init", "--topology", str(missing)))
    assert "unknown node 'delta'" in _one_line_error(run("fabric", "init", "--node", "delta"))


def test_init_refuses_a_foreign_state_file(run, state_path):
    conn = sqlite3.connect(state_path)
    conn.execute("CREATE TABLE photos (id INTEGER)")
    conn.commit()
    conn.close()
    before = state_path.read_bytes()
    line = _one_line_error(run("fabric", "init"))
    assert "another application (tables: photos)" in line
    assert state_path.read_bytes() == before
    assert "another application" in _one_line_error(run("devices"))


def test_garbage_state_file_is_one_line_error(run, state_path):
    state_path.write_bytes(b"\x00garbage" * 100)
    assert "not an SQLite database" in _one_line_error(run("fabric", "show"))


def test_show(run, inited):
    r = run("fabric", "show")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "fabric 'default'" in out
    assert "gamma (this host)  12" in out
    assert "alpha:0  PXH830  0/30" in out and "0/128G" in out and "0/32 x 4G" in out
    assert "switch mxs824: alpha:0, beta:0, gamma:0" in out
    with open_fabric(inited) as f:
        f.reserve(0x10, Holder("gamma", "vm1"), guest_ram=16 * (1 << 30))
    out = run("fabric", "show").output
    # a 16 GiB q35 guest: low RAM in 1 segment, high RAM 4-20 GiB in 4: 20 GiB of window
    assert "alpha:0  PXH830  1/30             20G/128G" in out
    assert "gamma:0  PXH830  1/30             40G/128G" in out


def test_show_json(run, inited):
    r = run("fabric", "show", "--json")
    data = json.loads(r.output)
    assert data["local_node"] == "gamma"
    assert [(n["name"], n["id"]) for n in data["nodes"]] == [
        ("alpha", 4),
        ("beta", 8),
        ("gamma", 12),
    ]
    a = data["nodes"][0]["adapters"][0]
    assert (a["ref"], a["lut_usable"], a["lut_used"], a["window_size"]) == (
        "alpha:0", 30, 0, 128 << 30,
    )  # fmt: skip
    assert data["links"] == [
        {"ends": ["alpha:0", "beta:0", "gamma:0"], "switch": "mxs824"},
        {"ends": ["gamma:1"], "switch": "mxs824b"},  # gamma's second path (issue 23)
    ]


def test_devices_table_and_filters(run, inited):
    r = run("devices")
    assert r.exit_code == 0
    lines = r.output.splitlines()
    assert lines[0].split() == ["FDID", "LENDER", "BDF", "KIND", "BARS", "DMA", "STATE", "HOLDER"]
    assert lines[1].split() == [
        "0x10", "alpha", "0000:41:00.0", "gpu", "16M,32G,32M", "40-bit", "available", "-",
    ]  # fmt: skip
    assert len(lines) == 10
    beta = run("devices", "--lender", "beta", "--json")
    assert len(json.loads(beta.output)["devices"]) == 6
    gpus = json.loads(run("devices", "--kind", "gpu", "--json").output)["devices"]
    assert [d["fdid"] for d in gpus] == ["0x10", "0x11", "0x20"]
    assert "unknown node 'delta'" in _one_line_error(run("devices", "--lender", "delta"))


def test_devices_show_holders_and_availability(run, inited):
    with open_fabric(inited) as f:
        f.reserve(0x11, Holder("gamma", "vm1", "u-1"))
        f.borrow(0x11, Holder("gamma", "vm1", "u-1"))
    data = {d["fdid"]: d for d in json.loads(run("devices", "--json").output)["devices"]}
    assert data["0x11"]["state"] == "borrowed"
    assert data["0x11"]["holder"] == {"node": "gamma", "vm": "vm1", "vm_uuid": "u-1"}
    assert data["0x10"]["bars"][1] == {
        "index": 1,
        "size": 32 << 30,
        "kind": "mem64",
        "prefetch": True,
    }
    assert data["0x22"]["physfn"] == "0x21"
    avail = json.loads(run("devices", "--available", "--json").output)["devices"]
    assert "0x11" not in [d["fdid"] for d in avail] and len(avail) == 8
    assert "gamma/vm1" in run("devices").output


def test_lend_and_unlend(run, inited):
    r = run("unlend", "0x10")
    assert r.exit_code == 0 and r.output.strip() == (
        "device 0x10 (gpu 0000:41:00.0 on alpha): unlent"
    )
    assert json.loads(run("devices", "--json").output)["devices"][0]["state"] == "unlent"
    r = run("lend", "16", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["state"] == "available"


def test_unlend_refused_while_held(run, inited):
    with open_fabric(inited) as f:
        f.reserve(0x20, Holder("gamma", "vm7"))
    line = _one_line_error(run("unlend", "0x20"))
    assert line == "Error: device 0x20 is held by gamma/vm7"
    assert json.loads(run("devices", "--json").output)["devices"][3]["state"] == "reserved"


def test_lend_bad_input(run, inited):
    assert "unknown device fdid 0x99" in _one_line_error(run("lend", "0x99"))
    r = run("unlend", "zz")  # a usage error: exit 2, click's usage hint, then one error line
    assert r.exit_code == 2
    assert "Error: Invalid value for 'FDID': bad fabric device id 'zz'" in r.output
    assert "Traceback" not in r.output
    r = run("lend")
    assert r.exit_code == 2 and "name one device (FDID) or --all" in r.output
    r = run("lend", "0x10", "--all")
    assert r.exit_code == 2 and "not both" in r.output
    r = run("lend", "0x10", "--lender", "alpha")
    assert r.exit_code == 2 and "--lender goes with --all" in r.output
    line = _one_line_error(run("lend", "--all", "--lender", "omega"))
    assert "no node 'omega' in the fabric" in line


def test_lend_all_lends_every_device_of_one_lender(run, inited):
    devices = json.loads(run("devices", "--json").output)["devices"]
    alphas = sorted(d["fdid"] for d in devices if d["lender"] == "alpha")
    assert run("unlend", "0x10").exit_code == 0
    r = run("lend", "--all", "--lender", "alpha")
    assert r.exit_code == 0, r.output
    assert r.output.strip() == (
        f"lent {len(alphas)} devices of alpha ({len(alphas) - 1} were lent already)"
    )
    after = json.loads(run("devices", "--json").output)["devices"]
    assert all(d["state"] == "available" for d in after if d["lender"] == "alpha")
    data = json.loads(run("lend", "--all", "--lender", "alpha", "--json").output)
    assert data["lender"] == "alpha" and sorted(d["fdid"] for d in data["devices"]) == alphas
    # without --lender: this host's own devices (gamma's)
    gammas = [d for d in devices if d["lender"] == "gamma"]
    r = run("lend", "--all")
    assert r.exit_code == 0 and r.output.startswith(f"lent {len(gammas)} devices of gamma")


def test_node_down_and_up(run, inited):
    r = run("fabric", "node-down", "alpha", "--why", "power lost")
    assert r.exit_code == 0
    data = {d["fdid"]: d["state"] for d in json.loads(run("devices", "--json").output)["devices"]}
    assert data["0x10"] == data["0x12"] == "unavailable" and data["0x20"] == "available"
    assert "DOWN: power lost" in run("fabric", "show").output
    assert not json.loads(run("fabric", "show", "--json").output)["nodes"][0]["up"]
    assert run("fabric", "node-up", "alpha").exit_code == 0
    assert json.loads(run("devices", "--json").output)["devices"][0]["state"] == "available"
    assert "unknown node 'delta'" in _one_line_error(run("fabric", "node-down", "delta"))


def test_reclaim_ends_the_hold_and_keeps_the_device_lent(run, inited):
    with open_fabric(inited) as f:
        f.reserve(0x20, Holder("gamma", "vm7"))
    r = run("fabric", "reclaim", "0x20")
    assert r.exit_code == 0 and "reclaimed from gamma/vm7" in r.output
    assert json.loads(run("devices", "--json").output)["devices"][3]["state"] == "available"
    assert "was not held" in run("fabric", "reclaim", "0x20").output
    assert "unknown" in _one_line_error(run("fabric", "reclaim", "0x99"))


def test_global_node_option_selects_the_view(run, inited):
    r = run("--node", "beta", "fabric", "show", "--json")
    assert json.loads(r.output)["local_node"] == "beta"
    assert "unknown node 'zeta'" in _one_line_error(run("--node", "zeta", "devices"))


@pytest.mark.slow  # two demo runs, 15 hook subprocesses each, as tests/scenarios/test_demo.py
def test_demo_on_fresh_state(run, state_path):
    r = run("demo")
    assert r.exit_code == 0, r.output
    assert "== 1. " in r.output and "== 3. " in r.output
    assert "created: state" in r.output
    assert "switch mxs824" in r.output and "16M,32G,32M" in r.output
    again = run("demo")
    assert again.exit_code == 0 and "unchanged: state" in again.output


def test_node_down_up_and_reclaim_json_say_what_they_did(run, inited):
    def doc(*args: str) -> dict[str, object]:
        r = run("fabric", *args, "--json")
        assert r.exit_code == 0, r.output
        data = json.loads(r.stdout)
        assert data.pop("format") == "vmlend/1"
        return data

    assert doc("node-down", "alpha", "--why", "power lost") == {
        "action": "marked_down",
        "node": "alpha",
        "why": "power lost",
    }
    assert doc("node-down", "alpha")["action"] == "unchanged"
    assert doc("node-up", "alpha") == {"action": "marked_up", "node": "alpha"}
    assert doc("node-up", "alpha")["action"] == "unchanged"
    with open_fabric(inited) as f:
        f.reserve(0x20, Holder("gamma", "vm7"))
    assert doc("reclaim", "0x20") == {"action": "reclaimed", "fdid": "0x20", "holder": "gamma/vm7"}
    assert doc("reclaim", "0x20") == {"action": "unchanged", "fdid": "0x20", "holder": None}
