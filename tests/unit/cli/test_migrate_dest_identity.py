"""``migrate --to NODE --dest-uri URI`` checks that URI reaches NODE's hypervisor, by the host
UUIDs the registry records per node the first time vmlend talks to a node's hypervisor: a URI
that reaches another node's hypervisor, or a hypervisor other than the one recorded for NODE,
is refused with nothing changed."""

from __future__ import annotations

import pytest

from tests.support.cli_cluster import GAMMA
from vmlend.errors import ConfigError
from vmlend.ops.hvidentity import META_PREFIX, check_hypervisor_is

TEST_URI = "test:///default"  # libvirt's test driver: a real libvirt URI with a host UUID


def recorded(cluster) -> dict[str, str]:
    with cluster.fabric() as f, f.registry.read() as tx:
        return {
            n: v for n in ("alpha", "beta", "gamma") if (v := tx.meta(META_PREFIX + n)) is not None
        }


def record(cluster, node: str, uuid: str) -> None:
    with cluster.fabric() as f:
        f.registry.transact(lambda tx: tx.set_meta(META_PREFIX + node, uuid))


def test_a_migrate_records_both_ends_and_the_simulated_nodes_differ(cluster):
    cluster.define("gamma", "vm1", [0x10])
    r = cluster.cli("migrate", "vm1", "--to", "beta", *GAMMA)
    assert r.exit_code == 0, r.output
    uuids = recorded(cluster)
    assert set(uuids) == {"gamma", "beta"} and uuids["gamma"] != uuids["beta"]
    assert uuids["beta"] == cluster.hv("beta").host_uuid()  # stable: derived, not random
    back = cluster.cli("migrate", "vm1", "--to", "gamma", "-c", "sim:///beta")
    assert back.exit_code == 0, back.output
    assert recorded(cluster) == uuids


class Reached:
    """A hypervisor as the check sees it: a URI and the host UUID behind it."""

    def __init__(self, uri: str, host: str) -> None:
        self.uri = uri
        self._host = host

    def host_uuid(self) -> str:
        return self._host


ALPHA_HOST = "00000000-0000-0000-0000-0000000000a1"


def test_dest_uri_reaching_another_nodes_hypervisor_is_refused(cluster):
    with cluster.fabric() as f:
        check_hypervisor_is(f, Reached("qemu+ssh://alpha/system", ALPHA_HOST), "alpha", "-c")
        before = cluster.snapshot()
        # the same daemon through another URI is still alpha's
        dest = Reached("qemu+tcp://10.0.0.1/system", ALPHA_HOST)
        with pytest.raises(ConfigError) as refused:
            check_hypervisor_is(f, dest, "beta", "--dest-uri")
    assert str(refused.value) == (
        f"--dest-uri qemu+tcp://10.0.0.1/system is node alpha's hypervisor (host UUID"
        f" {ALPHA_HOST}), not beta's: give the libvirt URI of node beta"
    )
    assert cluster.snapshot() == before
    assert recorded(cluster) == {"alpha": ALPHA_HOST}


def test_another_hypervisor_than_the_one_recorded_for_the_node_is_refused(cluster):
    record(cluster, "beta", "00000000-0000-0000-0000-0000000000be")
    with cluster.fabric() as f, pytest.raises(ConfigError) as refused:
        check_hypervisor_is(f, Reached("qemu:///system", ALPHA_HOST), "beta", "--dest-uri")
    assert str(refused.value) == (
        f"--dest-uri qemu:///system is not node beta's hypervisor: its host UUID is"
        f" {ALPHA_HOST}, beta's is 00000000-0000-0000-0000-0000000000be; give the libvirt"
        " URI of node beta"
    )


def test_a_hypervisor_without_a_host_uuid_is_not_checked(cluster):
    cluster.define("gamma", "vm1", [0x10])
    r = cluster.cli("migrate", "vm1", "--to", "beta", "--dest-uri", TEST_URI, *GAMMA)
    assert r.exit_code == 0, r.output
    assert "beta" not in recorded(cluster)  # libvirt's test driver reports none
