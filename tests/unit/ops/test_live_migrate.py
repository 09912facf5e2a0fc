"""``vmlend.ops.live_migrate`` between simulated nodes running the real vmlend hook (the CLI's
own tests are tests/unit/cli/test_cli_migrate_live.py): what the operation checks between its
steps."""

from __future__ import annotations

import pytest

from vmlend.errors import MigrationError
from vmlend.hypervisor import LiveMigration
from vmlend.ops.live_migrate import live_migrate
from vmlend.topology.model import GiB, Holder


def test_admission_is_checked_again_after_the_unplugs(cluster):
    """Between the unplugs and the move another VM may take a returned device: the move is
    refused then (the VM stays on the source, never runs on the destination without it)."""
    cluster.define("gamma", "vm1", [0x10], running=True)
    other = Holder("beta", "other")

    def meanwhile(line: str) -> None:  # another host's VM takes 0x10 as soon as it is back
        if line.startswith("device 0x10 unplugged from vm1 and returned"):
            with cluster.fabric("beta") as f:
                f.reserve(0x10, other, guest_ram=1 * GiB)

    with (
        cluster.fabric("gamma") as f,
        cluster.fabric("beta") as g,
        pytest.raises(MigrationError) as e,
    ):
        live_migrate(
            cluster.hv("gamma"),
            cluster.hv("beta"),
            f,
            g,
            "vm1",
            "beta",
            how=LiveMigration(),
            state_dir=cluster.state_path.parent,
            progress=meanwhile,
            unplug=True,  # the hot way never returns a device meanwhile
        )
    assert str(e.value).startswith(
        "live migration of VM 'vm1' to beta failed: device 0x10 is held by beta/other (taken"
        " while the devices were unplugged); it runs on gamma without device(s) 0x10"
    )
    assert cluster.hv("gamma").lookup("vm1").active  # it never left the source
    assert not any(d.name == "vm1" for d in cluster.hv("beta").list_domains())
    assert cluster.holds() == {0x10: "beta/other"}
