"""``vmlend reconcile`` on the kernel backend compares each running VM's peer-to-peer maps
(``p2p_state``, docs/smartio-contract.md section 8) with ``plan_p2p`` over the guest's BARs
now and with the VM's P2P claims, one line per difference, and plans and writes again where
that repairs it."""

# ruff: noqa: F811 (the tests take the imported fixtures as parameters)

from __future__ import annotations

import pytest

from tests.support.p2p_host import (  # noqa: F401
    BARS_A,
    BARS_B,
    HOOK_CHILDREN,
    p2p,
    web_with_maps,
)
from tests.support.smartio_host import fake, state  # noqa: F401
from vmlend.ops.reconcile import DriftKind, find_drift, fix, look
from vmlend.registry.records import ClaimKind

GPUS = (0x10, 0x20)
UA, UB = (HOOK_CHILDREN[f] for f in GPUS)


@pytest.fixture
def running(tmp_path, state, fake, p2p):
    """web runs here with GPUs 0x10 and 0x20, their maps written as the watcher writes them."""
    with web_with_maps(tmp_path, state, fake, p2p) as (hv, fabric):
        assert len(p2p.written(UA)) == len(p2p.written(UB)) == 3
        yield hv, fabric


def _p2p(hv, fabric):
    return [d for d in find_drift(look(hv, fabric)) if d.kind is DriftKind.P2P_MAPS]


def test_maps_the_watcher_wrote_are_no_drift(running):
    hv, fabric = running
    assert find_drift(look(hv, fabric)) == []


def test_a_move_whose_event_was_lost_is_drift_and_fix_maps_again(running, p2p):
    hv, fabric = running
    p2p.decode(UB, {**BARS_B, 1: 0xA0_0000_0000}, announce=False)  # the event is lost
    (d,) = _p2p(hv, fabric)
    assert d.fixable and d.fdid == 0x10 and d.mdev == UA
    assert d.cause == (
        f"mdev {UA} of device 0x10 (running VM 'web'): no peer-to-peer map to 0x20/bar1 (the"
        " guest decodes it at 0xa000000000+0x800000000, other-lender); 'vmlend reconcile"
        " --fix' writes the maps again"
    )
    lines: list[str] = []
    fix(hv, fabric, [d], lines.append)
    assert any("peer-to-peer maps of web planned and written again" in ln for ln in lines)
    assert (1, 0xA0_0000_0000) in {(ln.bar, ln.gpa) for ln in p2p.written(UA)}
    assert _p2p(hv, fabric) == []


def test_a_map_the_driver_keeps_for_a_bar_gone_is_drift(running, p2p):
    hv, fabric = running
    # a driver that failed to drop the map when the guest turned decoding off
    p2p.children[UB].decoded = {}
    p2p._sync(p2p.children[UB])
    causes = sorted(d.cause for d in _p2p(hv, fabric))
    assert len(causes) == 3
    gone = "a peer-to-peer map to 0x20/bar0 at 0xc1000000+0x1000000 that the guest's BARs do"
    assert gone in causes[0]


def test_more_segments_than_the_vm_claimed_is_drift_for_the_operator(running):
    hv, fabric = running

    def fewer(tx):
        kept = [
            (f, c)
            for f, c in tx.claims()
            if c.kind is ClaimKind.P2P and not c.share.endswith("0x20/bar1")
        ]
        tx.replace_claims(ClaimKind.P2P, list(GPUS), kept)

    fabric.registry.transact(fewer)
    (d,) = _p2p(hv, fabric)
    assert not d.fixable
    assert d.cause.endswith(
        "the peer-to-peer maps use 10 segment(s) of alpha:0, the VM's P2P claims 2"
    )


def test_maps_written_under_another_token_are_written_again(running, p2p):
    hv, fabric = running
    c = p2p.children[UA]
    hold = fabric._state.holds()[0x10].token
    c.token = hold - 1  # e.g. a write of an earlier hold of this VM's that the driver kept
    p2p._sync(c)
    (d,) = _p2p(hv, fabric)
    assert d.fixable
    assert f"written under fencing token {hold - 1}, the hold's is {hold}" in d.cause
    fix(hv, fabric, [d], lambda _line: None)
    assert p2p.children[UA].token == hold
    assert _p2p(hv, fabric) == []


def test_damaged_files_are_left_to_the_operator(running, p2p):
    hv, fabric = running
    (p2p.children[UB].group / "p2p_state").write_text("0x10 0 0xc0000000 0x1000000 sideways - -\n")
    (d,) = _p2p(hv, fabric)
    assert not d.fixable and d.mdev == UB
    assert "its peer-to-peer files are damaged" in d.cause and "unknown case" in d.cause
