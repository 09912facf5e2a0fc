"""Topology files: the default loads, and every kind of mistake is named precisely."""

from __future__ import annotations

import pytest

from vmlend.errors import ConfigError, TopologyError
from vmlend.topology.model import BarKind, GiB, parse_fdid
from vmlend.topology.parse import load_topology, parse_topology

MINI = """
name = "mini"
[[node]]
name = "a"
id = 1
  [[node.adapter]]
  index = 0
  window = "8GiB"
  segments = 8
  [[node.device]]
  fdid = 0x1
  bdf = "0000:01:00.0"
  kind = "gpu"
  vendor = 0x10de
  device = 0x1
  class = 0x030000
  bars = [ { index = 0, size = "16MiB" } ]
[[node]]
name = "b"
id = 2
  [[node.adapter]]
  index = 0
[[link]]
ends = ["a:0", "b:0"]
"""


def test_default_topology_has_the_documented_cluster():
    topo = load_topology()
    assert [n.name for n in topo.nodes] == ["alpha", "beta", "gamma"]
    by_lender = {n.name: [d.kind for d in topo.devices if d.lender == n.name] for n in topo.nodes}
    assert by_lender == {
        "alpha": ["gpu", "gpu", "nvme"],
        "beta": ["gpu", "nic", "vf", "vf", "vf", "vf"],
        "gamma": [],
    }
    gpu = topo.device(0x10)
    assert gpu.dma_bits == 40
    assert any(b.kind is BarKind.MEM64 and b.size == 32 * GiB for b in gpu.bars)
    vfs = [d for d in topo.devices if d.physfn == 0x21]
    assert [d.fdid for d in vfs] == [0x22, 0x23, 0x24, 0x25]
    assert len({d.bdf for d in vfs}) == 4
    assert all(a.lut_usable == 30 for a in topo.adapters())


def test_minimal_topology_parses():
    topo = parse_topology(MINI, "mini.toml")
    assert topo.node("b").adapters[0].window_size == 128 * GiB
    assert topo.links[0].ends == ("a:0", "b:0")


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [
        ('size = "16MiB"', 'size = "3000"', "node[0] 'a'.device[0].bars[0].size"),
        ('size = "16MiB"', 'size = "16MB"', "node[0] 'a'.device[0].bars[0].size"),
        ("fdid = 0x1", 'fdid = "x"', "node[0] 'a'.device[0].fdid"),
        ('ends = ["a:0", "b:0"]', 'ends = ["a:0", "c:0"]', "link[0].ends[1]"),
        ('kind = "gpu"', 'kind = "gpu"\n  colour = "red"', "node[0] 'a'.device[0]"),
        ("id = 2", "id = 1", "node[1] 'b'.id"),
        ('bdf = "0000:01:00.0"', 'bdf = "1:0.0"', "node[0] 'a'.device[0].bdf"),
        ("segments = 8", "segments = 6", "node[0] 'a'.adapter[0].segments"),
    ],
)
def test_bad_fields_are_named(old, new, where):
    assert old in MINI
    with pytest.raises(TopologyError) as exc:
        parse_topology(MINI.replace(old, new, 1), "mini.toml")
    assert str(exc.value).startswith(f"mini.toml: {where}:")


def test_syntax_error_names_the_line():
    with pytest.raises(TopologyError, match=r"mini.toml: not valid TOML: .*line 5, column 6"):
        parse_topology(MINI.replace("id = 1", "id = = 1", 1), "mini.toml")


def test_duplicate_fdid_is_refused():
    dup = (
        MINI.replace('[[node]]\nname = "b"', '[[node]]\nname = "b"', 1)
        + """
"""
    )
    text = dup.replace(
        "  [[node.adapter]]\n  index = 0\n[[link]]",
        '  [[node.adapter]]\n  index = 0\n  [[node.device]]\n  fdid = 0x1\n  bdf = "0000:02:00.0"'
        '\n  kind = "nic"\n  vendor = 1\n  device = 2\n  class = 0x020000\n[[link]]',
    )
    with pytest.raises(TopologyError, match=r"fdid 0x1 is already used by a 0000:01:00.0"):
        parse_topology(text, "mini.toml")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(tmp_path / "nope.toml")


@pytest.mark.parametrize("text", ["0x10", "16", "0X10", "0x00000010", 16])
def test_fdid_forms(text):
    assert parse_fdid(text) == 16


@pytest.mark.parametrize(
    "text", ["१६", " 0x10 ", "16\n", "0b10000", "0o20", "1_6", "0x1_0", "+16", "-0", "", "0x", True]
)
def test_only_the_documented_fdid_forms_are_accepted(text):
    with pytest.raises(ConfigError, match="expected a number such as 0x10 or 16"):
        parse_fdid(text)


def test_the_cli_refuses_an_fdid_in_other_digits(tmp_path):
    from click.testing import CliRunner

    from vmlend.cli import main

    r = CliRunner().invoke(main, ["--state", str(tmp_path / "s.db"), "lend", "१६"])
    assert r.exit_code == 2 and "bad fabric device id '१६'" in r.output
    assert "Traceback" not in r.output


def test_routes_through_the_switch_and_back_to_back():
    from vmlend.errors import NoPathError, UnknownNodeError
    from vmlend.topology.paths import route

    topo = load_topology()
    p = route(topo, "gamma", "alpha")
    assert (p.src.ref, p.dst.ref, p.switch) == ("gamma:0", "alpha:0", "mxs824")
    assert route(topo, "alpha", "alpha") is None
    mini = parse_topology(MINI, "mini.toml")
    assert route(mini, "a", "b").switch is None
    with pytest.raises(UnknownNodeError):
        route(mini, "a", "zz")
    isolated = parse_topology(MINI.replace('[[link]]\nends = ["a:0", "b:0"]\n', ""), "m.toml")
    with pytest.raises(NoPathError, match="no NTB path from a to b"):
        route(isolated, "a", "b")


# --- numbers bounded by what the hardware holds (refused when the topology is read) ---------


@pytest.mark.parametrize(
    ("old", "new", "where", "why"),
    [
        ('window = "8GiB"', 'window = "1"', "adapter[0].window", "less than a 4KiB page"),
        ('window = "8GiB"', 'window = "16KiB"', "adapter[0].window", "at least 32KiB"),
        ('window = "8GiB"', f"window = {1 << 70}", "adapter[0].window", "at most 4096TiB"),
        ('size = "16MiB"', f'size = "{1 << 40}TiB"', "bars[0].size", "at most 4096TiB"),
        ("id = 1", 'id = 1\nram = "1"', ".ram", "at least 1MiB"),
        ("id = 1", 'id = 1\nram = "8192TiB"', ".ram", "at most 4096TiB"),
    ],
)
def test_sizes_beyond_what_a_host_holds_are_refused(old, new, where, why):
    assert old in MINI
    with pytest.raises(TopologyError, match=why) as exc:
        parse_topology(MINI.replace(old, new, 1), "mini.toml")
    assert where in str(exc.value)


@pytest.mark.parametrize("nest", ["[" * 5000 + "]" * 5000, "{a = " * 5000 + "1" + "}" * 5000])
def test_a_value_nested_thousands_deep_is_one_line_not_a_recursion_error(nest):
    with pytest.raises(TopologyError, match="nested too deeply"):
        parse_topology(MINI + f"\nx = {nest}\n", "deep.toml")


def test_a_huge_text_is_not_parsed():
    with pytest.raises(TopologyError, match=r"is not a topology \(at most 67108864\)"):
        parse_topology(MINI + "#" * (64 << 20), "huge.toml")


def test_a_text_of_a_4096_node_fabric_is_not_too_large():
    # ~17 MB in the indented style: the 4 MiB cap refused 1,024 nodes (here: a long comment)
    assert parse_topology(MINI + "#" * (17 << 20), "big.toml").nodes


def test_fabric_init_reads_a_topology_file_over_the_other_inputs_cap(tmp_path):
    from click.testing import CliRunner

    from vmlend import safefile
    from vmlend.cli import main

    path = tmp_path / "big.toml"
    path.write_text(MINI + "#" * (safefile.MAX_INPUT_BYTES + 1))
    r = CliRunner().invoke(
        main, ["--state", str(tmp_path / "s.db"), "fabric", "init", "--topology", str(path)]
    )
    assert r.exit_code == 0, r.output


def test_fabric_init_refuses_them_in_one_line(tmp_path):
    from click.testing import CliRunner

    from vmlend.cli import main

    path = tmp_path / "bad.toml"
    path.write_text(MINI.replace('window = "8GiB"', 'window = "1"'))
    r = CliRunner().invoke(
        main, ["--state", str(tmp_path / "s.db"), "fabric", "init", "--topology", str(path)]
    )
    assert r.exit_code != 0 and "page per segment" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
