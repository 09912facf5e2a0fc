"""User-facing lines: no repeated subjects, right plurals, no internal names, typos refused,
files keeping their owner and mode."""

from __future__ import annotations

import os

from lxml import etree

from tests.support.cli_cluster import GAMMA, one_line
from vmlend.domain.metadata import DeviceEntryXML
from vmlend.errors import DomainXMLError, ResourceExhaustedError


def test_an_unknown_kind_is_an_error_like_an_unknown_lender(cluster):
    line = one_line(cluster.cli("devices", "--kind", "bogus"))
    assert "no device of kind 'bogus'" in line and "gpu" in line
    assert cluster.cli("devices", "--kind", "gpu").exit_code == 0
    # a kind the fabric has and the lender lends none of: an empty list, not an error
    line = one_line(cluster.cli("devices", "--lender", "beta", "--kind", "bogus"))
    assert "no device of kind 'bogus'" in line
    r = cluster.cli("devices", "--json", "--lender", "alpha", "--kind", "nic")
    assert r.exit_code == 0 and '"devices": []' in r.stdout, r.output


def test_status_of_a_vm_without_remote_devices_says_so(cluster):
    cluster.define("gamma", "plain")
    r = cluster.cli("status", "plain", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "VM 'plain' has no remote devices" in r.stdout


def test_xml_new_warns_when_the_device_id_was_not_checked(tmp_path):
    from click.testing import CliRunner

    from vmlend.cli import main

    out = tmp_path / "vm.xml"
    r = CliRunner().invoke(
        main,
        [
            "--state",
            str(tmp_path / "none.db"),
            "xml",
            "new",
            "vm",
            "--device",
            "0x10",
            "-o",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "warning" in r.stderr and "checked for syntax only" in r.stderr
    assert "(1 remote device)" in r.stderr


def test_add_device_keeps_the_files_owner_and_mode(cluster, tmp_path):
    out = tmp_path / "vm.xml"
    assert cluster.cli("xml", "new", "vm", "-o", str(out)).exit_code == 0
    os.chown(out, 4321, 4322)  # the tests run as root, as CI does
    os.chmod(out, 0o640)
    assert cluster.cli("xml", "add-device", str(out), "0x10").exit_code == 0
    st = out.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (4321, 4322, 0o640)
    assert cluster.cli("xml", "remove-device", str(out), "0x10").exit_code == 0
    st = out.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (4321, 4322, 0o640)


def test_shortages_count_in_the_singular_and_plural():
    e = ResourceExhaustedError("NTB window segments", "gamma:0", 3, 2, "segments")
    assert str(e) == (
        "NTB window segments on gamma:0 is short by 1 segment (need 3 segments, have 2 segments)"
    )
    e = ResourceExhaustedError("requester LUT", "b:0", 1, 0, "entries")
    assert "short by 1 entry (need 1 entry, have 0 entries)" in str(e)


def test_bad_xml_values_name_the_element_not_a_python_class():
    el = etree.fromstring('<device xmlns="http://vmlend.org/xmlns/domain/1.0" fdid="zz"/>')
    try:
        _ = DeviceEntryXML(el).fdid
    except DomainXMLError as e:
        assert "DeviceEntryXML" not in str(e) and "./@fdid" in str(e)
    else:
        raise AssertionError("a bad fdid was accepted")


def test_a_refused_migration_does_not_repeat_the_device(cluster):
    cluster.define("gamma", "vm1", [0x10])
    cluster.define("gamma", "vm2", [0x10], running=True)  # holds 0x10
    line = one_line(cluster.cli("migrate", "vm1", "--to", "alpha", *GAMMA))
    assert "device 0x10: device 0x10" not in line
    assert line.endswith("nothing was changed")


def test_a_newline_in_a_value_an_error_quotes_stays_one_line(tmp_path):
    # Found by tests/scenarios/test_fuzz_boundaries.py: libvirt's reason repeated the URI's newline.
    from click.testing import CliRunner

    from vmlend.cli import main

    r = CliRunner().invoke(main, ["--state", str(tmp_path / "s.db"), "status", "-c", "a\nb"])
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "a\\nb" in r.stderr
