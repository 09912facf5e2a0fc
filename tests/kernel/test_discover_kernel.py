"""``vmlend fabric discover`` on the real kernel: the stand-in module serves this host's NTB
adapters (docs/smartio-contract.md, section 1) beside its devices, vmlend's reader takes them
from sysfs, and the command merges the host into a private state."""

from __future__ import annotations

import errno
import json
import stat

import pytest
from click.testing import CliRunner

from tests.support.kernel_guest import NODE_ID, REAL, STUB
from vmlend.cli import main
from vmlend.kernel.adapters import read_adapters
from vmlend.topology.discovered import FoundAdapter
from vmlend.wiring.fabric import open_fabric

ADAPTER_FILES = (
    "index", "model", "window_size", "segments", "lut_entries", "link", "peer", "switch_port",
)  # fmt: skip


def test_the_stand_in_serves_this_hosts_adapters_as_the_contract_says():
    STUB.add_adapter(0, switch_port=2)
    STUB.add_adapter(1, model="MXH932", window_size=1 << 40, segments=256, lut_entries=64,
                     peer=(4, 1))  # fmt: skip
    STUB.add_adapter(2, link="down")
    assert read_adapters(REAL) == [
        FoundAdapter(0, "PXH830", 128 << 30, 32, 32, True, None, 2),
        FoundAdapter(1, "MXH932", 1 << 40, 256, 64, True, (4, 1), None),
        FoundAdapter(2, "PXH830", 128 << 30, 32, 32, False, None, None),
    ]
    d = STUB.base / "adapter1"
    assert (d / "peer").read_text() == "4 1\n" and (d / "switch_port").read_text() == "\n"
    assert (d / "window_size").read_text() == "0x10000000000\n"
    for name in ADAPTER_FILES:
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o444, name
    with pytest.raises(OSError) as e:
        STUB.add_adapter(1)
    assert e.value.errno == errno.EEXIST
    with pytest.raises(OSError) as e:
        STUB.ctl("adapter 3 PXH830 0x2000000000 32 32 sideways - -")
    assert e.value.errno == errno.EINVAL
    STUB.reset()
    assert read_adapters(REAL) == []


def test_fabric_discover_merges_this_host_from_the_stand_in(fabric_devices, state_path,
                                                            monkeypatch):  # fmt: skip
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    STUB.add_adapter(0, switch_port=2)  # gamma's two adapters on the shipped cluster's switches
    STUB.add_adapter(1, switch_port=0)
    STUB.add(0x40, NODE_ID, bdf="0000:05:00.0", class_code=0x010802)  # a drive of gamma's own

    def run(*args: str):
        r = CliRunner().invoke(main, list(args))
        assert r.exit_code == 0, r.output
        return r

    run("fabric", "init", "--node", "gamma")
    data = json.loads(run("fabric", "discover", "--json").stdout)
    assert (data["action"], data["node"]) == ("merged", "gamma")
    assert data["changes"] == [
        {"what": "device", "subject": "0x40", "action": "added",
         "detail": "nvme 0000:05:00.0 8086:0a54"},
    ]  # fmt: skip
    found = data["found"]
    assert found["node_id"] == NODE_ID and found["remote_devices"] == len(fabric_devices.devices)
    assert [(a["index"], a["switch_port"]) for a in found["adapters"]] == [(0, 2), (1, 0)]
    assert found["ram"] > 0  # the guest's /proc/meminfo
    with open_fabric(state_path, backend="sim") as f:
        assert f.topology().device(0x40).lender == "gamma"
    again = json.loads(run("fabric", "discover", "--json").stdout)
    assert again["action"] == "unchanged" and again["changes"] == []
