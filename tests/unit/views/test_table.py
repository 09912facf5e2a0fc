"""Text tables: one line per row whatever a cell holds (a VM's name in a hold comes from the
registry, and libvirt or the simulated hypervisor gave it)."""

from __future__ import annotations

from click.testing import CliRunner

from tests.support.simfabric import make_fabric
from vmlend.cli import main
from vmlend.topology.model import Holder
from vmlend.views.table import render_table

FORGED = "web\n0x99   gpu   alpha   available"


def test_a_cell_with_a_newline_stays_in_its_row():
    text = render_table(("FDID", "HOLDER"), [("0x10", FORGED), ("0x11", "\x1b[2Jdb")])
    assert text.splitlines() == [
        "FDID  HOLDER",
        "0x10  web\\n0x99   gpu   alpha   available",
        "0x11  \\x1b[2Jdb",
    ]


def test_a_hold_by_a_vm_named_with_a_newline_forges_no_row_of_devices(state_path):
    with make_fabric(state_path) as fabric:
        fabric.reserve(0x10, Holder("gamma", FORGED))
        count = len(fabric.devices())
    r = CliRunner().invoke(main, ["--state", str(state_path), "--node", "gamma", "devices"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) == 1 + count  # the header and one row a device
    (row,) = [line for line in lines if line.startswith("0x10 ")]
    assert "gamma/web\\n0x99   gpu   alpha   available" in row
