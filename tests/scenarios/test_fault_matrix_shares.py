"""``kill -9`` at every step boundary of an unplugged live migration of a VM with a
queue-level NVMe share (and a GPU), then recovery with the tool itself: the same command
again, or ``--rollback``. Either way the share keeps its identity (its blocks, queues and
address space) and ends plugged at its guest address on one node only, nothing of it is left
claimed for the other, and ``reconcile`` finds no drift (docs/testing.md, the matrix)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_cluster import GAMMA, SimCluster
from tests.support.handover_checks import registry_violations
from tests.support.killed_cli import assert_killed as _killed
from tests.support.killed_cli import run_cli as _run
from tests.support.share_moves import (
    SHARE_AT,
    share_address,
    share_drive,
    share_mdevs,
    shares,
    start_sharing,
)

pytestmark = pytest.mark.daemon

#: The unplugged move's step boundaries, in the order it reaches them.
POINTS = [
    "share-move:after-claim",
    "live-migrate:after-unplug",
    "share-move:after-hand-over",
    "live-migrate:after-migrate",
    "live-migrate:after-replug",
]
ARGS = ("migrate", "vm1", "--to", "beta", "--live", "--unplug", *GAMMA)
IDENTITY = ("qid_base", "queue_pairs", "lba_offset", "blocks", "asid", "vector_base")


@pytest.fixture
def shared(cluster: SimCluster) -> SimCluster:
    share_drive(cluster)
    start_sharing(cluster, "gamma", "vm1", gpu=True)
    start_sharing(cluster, "beta", "sc")
    return cluster


def _identity(record: dict) -> dict:
    return {k: record["share"][k] for k in IDENTITY}


def _converged(cluster: SimCluster, node: str, was: dict, epoch: int) -> None:
    """vm1 runs on ``node`` only, its share (the same one, at ``epoch``) plugged there at its
    address; no drift anywhere, no claim left for the other node."""
    other = "gamma" if node == "beta" else "beta"
    for n in ("gamma", "beta"):
        res = _run(cluster.state_path, "reconcile", "-c", f"sim:///{n}", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["drift"] == [], (n, res.stdout)
    assert cluster.hv(node).lookup("vm1").active
    assert not any(d.name == "vm1" and d.active for d in cluster.hv(other).list_domains())
    now = shares(cluster)
    assert f"vm:{other}/vm1" not in now
    mine = now[f"vm:{node}/vm1"]
    assert _identity(mine) == _identity(was)
    assert mine.get("epoch", 0) == epoch
    assert "incoming" not in mine and "leaving" not in mine
    assert share_address(cluster, node) == SHARE_AT
    assert (node, "vm1") in share_mdevs(cluster) and (other, "vm1") not in share_mdevs(cluster)
    with cluster.fabric() as f:
        assert registry_violations(f.registry) == []


@pytest.mark.parametrize("point", POINTS)
def test_an_unplugged_share_move_killed_then_rerun(shared, point):
    was = shares(shared)["vm:gamma/vm1"]
    _killed(_run(shared.state_path, *ARGS, fault=point))
    res = _run(shared.state_path, *ARGS)
    assert res.returncode == 0, res.stderr
    _converged(shared, "beta", was, 1)


@pytest.mark.parametrize("point", POINTS)
def test_an_unplugged_share_move_killed_then_rolled_back(shared, point):
    was = shares(shared)["vm:gamma/vm1"]
    _killed(_run(shared.state_path, *ARGS, fault=point))
    res = _run(shared.state_path, *ARGS, "--rollback")
    assert res.returncode == 0, res.stderr
    # killed before the hand-over: the share never moved; after it: handed back (or moved
    # there and back), each time under a newer epoch
    _converged(shared, "gamma", was, 0 if point in POINTS[:2] else 2)


def test_a_rollback_killed_after_it_gave_the_share_back_converges_when_run_again(shared):
    was = shares(shared)["vm:gamma/vm1"]
    _killed(_run(shared.state_path, *ARGS, fault="share-move:after-hand-over"))
    rollback = (*ARGS, "--rollback")
    _killed(_run(shared.state_path, *rollback, fault="live-rollback:after-share-hand-back"))
    back = shares(shared)["vm:gamma/vm1"]
    assert back["epoch"] == 2 and share_address(shared, "gamma") is None  # not plugged yet
    res = _run(shared.state_path, *rollback)
    assert res.returncode == 0, res.stderr
    _converged(shared, "gamma", was, 2)
