"""Link faults in the simulator (issue 23 part 3): a cable goes down and comes back.

Through a dead cable the adapter answers a read with all ones and drops a write, as the papers
say the PXH830 does; the mappings themselves stay. A cable that comes back either kept its
mappings (everything works again) or its adapters were reset (the mappings are gone and a DMA
faults where the lost state was). New routes avoid dead cables."""

from __future__ import annotations

import json

import pytest

from tests.support.simcluster import domain_xml
from vmlend.errors import ConfigError, DmaFault, FabricError, NoPathError
from vmlend.topology.model import GiB

GPA = 64 * 4096  # a page of the guest's low RAM
PRIMARY = "mxs824/gamma:0"  # gamma's cable on the primary route from alpha
BACKUP = "mxs824b/gamma:1"


@pytest.fixture
def vm(cluster):
    vm = cluster.start(domain_xml("web", 1 * GiB, fdids=(0x12,)))
    vm.enable_device(0x12)
    vm.guest.write(GPA, b"guest data")
    return vm


def test_a_dead_link_reads_all_ones_and_drops_writes(cluster, vm):
    hw = cluster.hw
    assert hw.dma_read(0x12, GPA, 10) == b"guest data"
    segments_before = hw.adapter("alpha:0").mapped_segments()
    assert hw.link_down(PRIMARY) is True
    assert hw.link_down(PRIMARY) is False  # already down
    assert hw.links()[PRIMARY] is False and hw.links()[BACKUP] is True
    with pytest.raises(DmaFault) as fault:
        hw.resolve_dma(0x12, GPA)
    assert fault.value.hop == "link-down" and PRIMARY in fault.value.why
    assert hw.dma_read(0x12, GPA, 10) == b"\xff" * 10
    assert hw.dma_write(0x12, GPA, b"lost write") == []  # dropped
    assert vm.guest.read(GPA, 10) == b"guest data"
    # the mappings stay while it is down
    assert hw.adapter("alpha:0").mapped_segments() == segments_before


def test_a_link_back_with_its_mappings_works_again(cluster, vm):
    hw = cluster.hw
    hw.link_down(PRIMARY)
    assert hw.link_up(PRIMARY) is True
    assert hw.link_up(PRIMARY) is False  # already up
    assert hw.dma_read(0x12, GPA, 10) == b"guest data"
    hw.dma_write(0x12, GPA, b"after link")
    assert vm.guest.read(GPA, 10) == b"after link"
    assert hw.link_log == [(PRIMARY, "down"), (PRIMARY, "up")]


def test_a_link_back_without_its_mappings_faults_where_the_state_was_lost(cluster, vm):
    hw = cluster.hw
    key = hw.requester_key(0x12)
    assert hw.adapter("gamma:0").lut_lookup(key) is not None
    hw.link_down(PRIMARY)
    hw.link_up(PRIMARY, keep_mappings=False)
    # gamma:0 was reset: its LUT entry for the drive is gone, so gamma drops the DMA
    assert hw.adapter("gamma:0").lut() == {}
    with pytest.raises(DmaFault) as fault:
        hw.resolve_dma(0x12, GPA, write=True)
    assert fault.value.hop == "lut"
    assert hw.link_log[-1] == (PRIMARY, "up-lost")
    # the lender's cable reset: alpha:0 lost its window segments
    hw.link_down("mxs824/alpha:0")
    hw.link_up("mxs824/alpha:0", keep_mappings=False)
    assert hw.adapter("alpha:0").mapped_segments() == []
    with pytest.raises(DmaFault) as fault:
        hw.resolve_dma(0x12, GPA)
    assert fault.value.hop == "ntb-segment"


def test_a_dead_cable_off_the_path_changes_nothing(cluster, vm):
    cluster.hw.link_down("mxs824/beta:0")
    cluster.hw.link_down(BACKUP)
    assert cluster.hw.dma_read(0x12, GPA, 10) == b"guest data"


def test_new_routes_avoid_dead_cables_and_events_are_heard(cluster):
    hw = cluster.hw
    heard: list[tuple[str, bool]] = []
    remove = hw.on_link_change(lambda name, up: heard.append((name, up)))
    assert hw.route("alpha", "gamma").dst.ref == "gamma:0"
    hw.link_down(PRIMARY)
    assert hw.route("alpha", "gamma").dst.ref == "gamma:1"
    hw.link_down(BACKUP)
    with pytest.raises(NoPathError):
        hw.route("alpha", "gamma")
    hw.link_up(BACKUP)
    remove()
    hw.link_up(PRIMARY)
    assert heard == [(PRIMARY, False), (BACKUP, False), (BACKUP, True)]
    assert hw.route("alpha", "gamma").dst.ref == "gamma:0"


def test_unknown_links_are_refused(cluster):
    with pytest.raises(FabricError, match="unknown link 'gamma:0'"):
        cluster.hw.link_down("gamma:0")
    with pytest.raises(FabricError, match="unknown link"):
        cluster.hw.link_up("mxs824/delta:0")
    with pytest.raises(ConfigError, match="unknown link"):
        cluster.fabric().set_link_up("nope", False)


def test_the_fabric_records_link_state_and_tells_its_hardware(cluster, vm):
    fabric = cluster.fabric()
    cluster.hw.link_down(BACKUP)  # nowhere to re-route to: the device reads all ones
    assert fabric.set_link_up(PRIMARY, False).changed is True
    assert fabric.links_down() == [PRIMARY]
    assert cluster.hw.dma_read(0x12, GPA, 4) == b"\xff" * 4
    assert fabric.set_link_up(PRIMARY, False).changed is False
    assert fabric.set_link_up(PRIMARY, True, keep_mappings=True).changed is True
    assert fabric.links_down() == [] and cluster.hw.dma_read(0x12, GPA, 4) == b"gues"


def test_link_down_and_up_commands(tmp_path):
    from click.testing import CliRunner

    from vmlend.cli import main

    state = ["--state", str(tmp_path / "s.db"), "--node", "gamma"]
    run = CliRunner().invoke
    assert run(main, [*state, "fabric", "init"]).exit_code == 0
    r = run(main, [*state, "fabric", "link-down", PRIMARY])
    assert r.exit_code == 0 and r.output.strip() == (
        f"link {PRIMARY} marked down; down now: {PRIMARY}"
    )
    again = json.loads(run(main, [*state, "fabric", "link-down", PRIMARY, "--json"]).output)
    assert again == {
        "format": "vmlend/1", "action": "unchanged",
        "link": PRIMARY, "state": "down", "changed": False, "mappings": None,
        "links_down": [PRIMARY], "devices": [],
    }  # fmt: skip
    shown = json.loads(run(main, [*state, "fabric", "show", "--json"]).output)
    assert {c["name"]: c["up"] for c in shown["cables"]}[PRIMARY] is False
    up = json.loads(run(main, [*state, "fabric", "link-up", PRIMARY, "--lost", "--json"]).output)
    assert (up["changed"], up["mappings"], up["links_down"]) == (True, "lost", [])
    bad = run(main, [*state, "fabric", "link-down", "gamma:9"])
    assert bad.exit_code != 0 and "unknown link 'gamma:9'" in bad.output


def test_a_reset_adapter_keeps_its_drivers_tables_until_restored(cluster, vm):
    hw = cluster.hw
    alpha = hw.adapter("alpha:0")
    segments, lut = alpha.mapped_segments(), alpha.lut()
    hw.link_down("mxs824/alpha:0")
    hw.link_up("mxs824/alpha:0", keep_mappings=False)
    assert alpha.lost and alpha.mapped_segments() == [] and alpha.lut() == {}
    # what was lost is still promised: nothing new takes its segments or entries
    assert alpha.free_segments(1) not in {s.index for s in segments}
    assert alpha.lut_add(0xBEEF) not in set(lut.values())
    alpha.lut_remove(0xBEEF)
    assert alpha.restore() == len(segments) + len(lut)
    assert not alpha.lost and alpha.mapped_segments() == segments and alpha.lut() == lut
    assert hw.dma_read(0x12, GPA, 10) == b"guest data"


def test_a_back_to_back_cable_resets_both_its_ends_and_a_switch_cable_none():
    from vmlend.sim.hardware import SimHardware
    from vmlend.topology.parse import parse_topology

    def node(name: str, ident: int) -> str:
        return f'[[node]]\nname = "{name}"\nid = {ident}\n' + "".join(
            f"  [[node.adapter]]\n  index = {i}\n" for i in range(2)
        )

    text = (
        node("a", 1) + node("d", 4)
        + '[[switch]]\nname = "s1"\nports = ["a:0"]\n[[switch]]\nname = "s2"\nports = ["d:0"]\n'
        + '[[switch_link]]\nends = ["s1", "s2"]\n[[link]]\nends = ["a:1", "d:1"]\n'
    )  # fmt: skip
    hw = SimHardware.from_topology(parse_topology(text, "t.toml"))
    assert set(hw.links()) == {"a:1-d:1", "s1/a:0", "s2/d:0", "s1-s2"}
    for ref in ("a:0", "a:1", "d:0", "d:1"):
        hw.adapter(ref).lut_add(0x100)
    hw.link_down("a:1-d:1")
    assert hw.route("a", "d").links == ("s1/a:0", "s1-s2", "s2/d:0")
    hw.link_up("a:1-d:1", keep_mappings=False)
    assert [hw.adapter(r).lost for r in ("a:0", "a:1", "d:0", "d:1")] == [False, True, False, True]
    assert hw.reprogram("a:1-d:1") == 2
    hw.link_down("s1-s2")
    hw.link_up("s1-s2", keep_mappings=False)  # no adapter at its ends: nothing is lost
    assert not any(a.lost for a in hw.adapters())
