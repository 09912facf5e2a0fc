"""virsh's conventions in attach/detach: --persistent and --current, detach --dry-run, -v after
the subcommand, dry runs listing every check."""

from __future__ import annotations

import json
import logging

import pytest

from tests.support.cli_cluster import GAMMA, metadata_fdids, one_line


def _config_fdids(cluster, name="vm1"):
    return metadata_fdids(cluster.hv("gamma").xml(name, inactive=True))


def _live_fdids(cluster, name="vm1"):
    return metadata_fdids(cluster.hv("gamma").xml(name))


def test_persistent_on_a_running_vm_changes_live_and_config(cluster):
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli("attach", "vm1", "0x10", "--persistent", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "(live+config)" in r.stdout
    assert (_live_fdids(cluster), _config_fdids(cluster)) == (["0x10"], ["0x10"])
    r = cluster.cli("detach", "vm1", "0x10", "--persistent", *GAMMA)
    assert r.exit_code == 0, r.output
    assert (_live_fdids(cluster), _config_fdids(cluster)) == ([], [])
    assert cluster.holds() == {}


def test_persistent_on_a_stopped_vm_changes_the_definition(cluster):
    cluster.define("gamma", "vm1")
    r = cluster.cli("attach", "vm1", "0x10", "--persistent", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "(config)" in r.stdout and _config_fdids(cluster) == ["0x10"]


def test_current_is_live_on_a_running_vm(cluster):
    cluster.define("gamma", "vm1", running=True)
    assert cluster.cli("attach", "vm1", "0x10", "--current", *GAMMA).exit_code == 0
    assert (_live_fdids(cluster), _config_fdids(cluster)) == (["0x10"], [])


@pytest.mark.parametrize("other", ["--live", "--config", "--persistent"])
def test_current_with_another_flag_is_a_usage_error(cluster, other):
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli("attach", "vm1", "0x10", "--current", other, *GAMMA)
    assert r.exit_code == 2 and "--current cannot be combined" in r.output


def test_detach_dry_run_shows_the_diff_and_changes_nothing(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    before = cluster.snapshot()
    r = cluster.cli("detach", "vm1", "0x10", "--dry-run", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "--- live XML (before)" in r.stdout and "-        <address uuid=" in r.stdout
    assert r.stdout.splitlines()[-1] == (
        "dry run: device 0x10 would be detached (live); nothing was changed"
    )
    assert cluster.snapshot() == before
    r = cluster.cli("detach", "vm1", "0x11", "--dry-run", "--json", *GAMMA)
    assert json.loads(r.stdout)["pending"] == []


def test_verbose_works_after_the_subcommand(cluster, caplog, request):
    logger = logging.getLogger("vmlend")
    request.addfinalizer(lambda level=logger.level: logger.setLevel(level))
    cluster.define("gamma", "vm1", [0x10, 0x11], running=True)

    def steps() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "vmlend.cli.cmd_attach"]

    assert cluster.cli("detach", "vm1", "0x11", *GAMMA).exit_code == 0
    assert steps() == []  # quiet without -v
    r = cluster.cli("detach", "vm1", "0x10", "-v", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "device 0x10: returned" in steps()


def test_a_dry_run_lists_every_check_even_after_one_fails(cluster):
    cluster.define("gamma", "vm1", running=True)
    cluster.define("gamma", "vm2", running=True)
    assert cluster.cli("attach", "vm2", "0x10", *GAMMA).exit_code == 0
    r = cluster.cli("attach", "vm1", "0x10", "--dry-run", "--json", *GAMMA)
    names = [c["name"] for c in json.loads(r.stdout)["checks"]]
    assert "not-held" in names and "dma-limit" in names


def test_a_refused_flag_combination_changes_nothing(cluster):
    cluster.define("gamma", "vm1")
    line = one_line(cluster.cli("attach", "vm1", "0x10", "--live", *GAMMA))
    assert "not running" in line
