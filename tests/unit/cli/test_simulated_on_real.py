"""A domain whose remote devices come from the simulated fabric runs only on ``sim:///``
nodes. Where the simulated backend is only the default (no SmartIO driver, no --backend),
starting such a domain or hot-adding a device on a real libvirt URI is refused before libvirt
is asked, with one line that says why and what to do; an explicit ``--backend sim`` goes on
to libvirt, and a simulated node is never refused."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.cli_cluster import GAMMA, one_line

WHY = "its remote devices come from the simulated fabric"


@pytest.fixture
def real_uri(cluster, tmp_path) -> str:
    """A libvirt test-driver host holding vm1 (with vmlend metadata) and the plain vm0, both
    running (the test driver starts what its node file holds): a real libvirt URI, not a
    simulated node."""
    cluster.define("gamma", "vm1", [0x10])
    xml = cluster.hv("gamma").xml("vm1", inactive=True).decode()
    xml = re.sub(r"<domain type=['\"]\w+['\"]", "<domain type='test'", xml, count=1)
    node = tmp_path / "host.xml"
    node.write_text(
        "<node>"
        "<cpu><mhz>2000</mhz><model>x86_64</model><active>2</active><nodes>1</nodes>"
        "<sockets>1</sockets><cores>2</cores><threads>1</threads></cpu>"
        "<memory>4194304</memory>"
        f"{xml}"
        "<domain type='test'><name>vm0</name><memory>65536</memory>"
        "<os><type>hvm</type></os></domain>"
        "</node>"
    )
    return f"test://{node}"


def test_start_with_simulated_devices_on_a_real_uri_is_refused_before_libvirt(cluster, real_uri):
    before = cluster.snapshot()
    line = one_line(cluster.cli("vm", "start", "vm1", "-c", real_uri))
    assert line.startswith(f"Error: cannot start VM 'vm1' on {real_uri}: {WHY}")
    assert "-c sim:///<node>" in line and "load the SmartIO driver" in line
    assert cluster.snapshot() == before


def test_hot_add_on_a_real_uri_is_refused_before_libvirt(cluster, real_uri):
    before = cluster.snapshot()
    line = one_line(cluster.cli("attach", "vm0", "0x12", "--live", "-c", real_uri))
    assert line.startswith(f"Error: cannot hot-add a device to VM 'vm0' on {real_uri}: {WHY}")
    assert cluster.snapshot() == before


def test_a_dry_run_predicts_that_refusal(cluster, real_uri):
    """'attach --dry-run --live' said the hot-add would go through where the live attach is
    refused: the prediction must match."""
    before = cluster.snapshot()
    r = cluster.cli("attach", "vm0", "0x12", "--live", "--dry-run", "-c", real_uri)
    assert r.exit_code == 1, (r.stdout, r.stderr)
    assert r.stdout.splitlines()[0].startswith("FAIL  hypervisor   cannot hot-add a device")
    assert "would be refused; nothing was changed" in r.stdout
    r = cluster.cli("attach", "vm0", "0x12", "--live", "--dry-run", "--json", "-c", real_uri)
    data = json.loads(r.stdout)
    assert data["ok"] is False and WHY in data["checks"][0]["detail"]
    assert cluster.snapshot() == before


def test_an_explicit_sim_backend_goes_on_to_libvirt(cluster, real_uri):
    line = one_line(cluster.cli("--backend", "sim", "vm", "start", "vm1", "-c", real_uri))
    assert line.startswith("Error: start vm1 refused: "), line  # libvirt's own answer


def test_a_plain_domain_on_a_real_uri_is_not_vmlends_business(cluster, real_uri):
    r = cluster.cli("vm", "start", "vm0", "-c", real_uri)
    assert WHY not in r.output


def test_a_simulated_node_starts_it(cluster):
    cluster.define("gamma", "vm1", [0x10])
    r = cluster.cli("vm", "start", "vm1", *GAMMA)
    assert r.exit_code == 0, r.output
