"""``vmlend registry upgrade``: bring a cluster's stored etcd layout to the one this vmlend
writes, one layout version at a time (``STEPS``).

An upgrade runs with every host's agent stopped and its lease ended: a live agent (its
``hosts/<node>`` key) refuses it in one line, and each step's transaction compares that no
``hosts/`` key appeared since its reads, so an agent started meanwhile makes the step run again
and be refused. With every lease ended, no hold, claim, unit block, VM marker, mdev or runtime
record is left (they are all on their host's lease); what a step converts is what has no
lease: the topology, node and device records, fences, agents' bindings, the version.

Each step is idempotent and its own transaction(s), within etcd's defaults (128 operations and
1.5 MiB a request: the topology's pieces are written by ``EtcdTopology.stage`` in requests of
their own before the step names them), and writes its target version last, in its final
transaction: a step cut short leaves the version it found, and running the command again
redoes it. Running it on a layout that is current changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import msgspec

from vmlend.errors import StateError
from vmlend.registry.api import StateTxn
from vmlend.registry.etcd_store import EtcdRegistry, check_schema
from vmlend.registry.etcd_txn import EtcdTxn
from vmlend.registry.schema import ETCD_SCHEMA_VERSION


class UpgradeResult(msgspec.Struct, frozen=True):
    registry: str
    before: int
    after: int
    #: What each step did, in order (empty: the layout was current).
    steps: list[str]


def _refuse_live_agents(tx: EtcdTxn, where: str) -> None:
    """One line when any agent's lease lives. Read as a compared prefix: an agent that starts
    before the step commits makes it run again, and be refused here."""
    alive = tx.live_hosts()
    if alive:
        raise StateError(
            f"cannot upgrade {where} while the vmlend agents of {', '.join(alive)} have a live"
            " lease: stop 'vmlend agent' on every host and wait until its lease ended (--ttl),"
            " or decommission the host with 'vmlend drain', then run 'vmlend registry upgrade'"
            " again"
        )


def _topology_in_generations(tx: EtcdTxn) -> str:
    """2 -> 3: the topology, one JSON value ``topology/record`` before, stored as a
    generation of pieces (what installing a topology writes since version 3)."""
    moved = tx.store_topology_in_generations()
    return (
        "the topology moved from one record into a generation of pieces"
        if moved
        else "the topology was in generations already"
    )


def _generation_read_in_chunks(tx: EtcdTxn) -> str:
    """3 -> 4: the topology's generation written again in format 2 (``topopieces``: read and
    verified a chunk at a time, so a command reads a few kilobytes of it, not all), its
    compiled form in format 7; its content otherwise unchanged."""
    return (
        "the topology's generation was written again, to be read a chunk at a time"
        if tx.rewrite_topology_generation()
        else "the topology's generation was of that format already"
    )


def _holds_in_units(tx: EtcdTxn) -> str:
    """4 -> 5: holds keep their claims in their VM's ledger and unit blocks, and the markers
    are the nodes' index (``etcd_keys``): what layout 4 left without a lease goes."""
    gone = tx.drop_layout4_holds()
    if not gone:
        return "no hold, claim or unit record was left (layout 5 keeps claims on unit blocks)"
    return (
        f"{gone} record(s) of holds, claims and units left without a lease deleted (their"
        " fences stay: the lenders take the devices back); layout 5 keeps claims on unit"
        " blocks"
    )


def _leftovers_dropped(tx: EtcdTxn, what: str) -> str:
    """Delete what the older layout left without a lease (``drop_layout4_holds``) and say
    how much, then ``what`` the new layout changes."""
    gone = tx.drop_layout4_holds()
    if not gone:
        return f"no hold, marker or unit record was left; {what}"
    return (
        f"{gone} record(s) of holds, markers and units left without a lease deleted (their"
        f" fences stay: the lenders take the devices back); {what}"
    )


def _own_places_decided(tx: EtcdTxn) -> str:
    """5 -> 6: a node's own places are decided by one process of the node (``decider``),
    within extents the first reserve takes: with every lease ended there is no VM block to
    convert; what layout 5 left without a lease goes, as in 4 -> 5."""
    return _leftovers_dropped(
        tx, "each node's own adapter places are decided by one process of the node"
    )


def _lent_entries_of_lenders(tx: EtcdTxn) -> str:
    """6 -> 7: a lent device's requester entries are its lender's, set aside by its first
    borrow (``EtcdTxn._lent_entry``): with every lease ended no hold needs one yet; what
    layout 6 left without a lease goes, as in 4 -> 5."""
    return _leftovers_dropped(
        tx, "a lent device's requester entries are its lender's, set aside at its first borrow"
    )


def _runs_of_units(_tx: EtcdTxn) -> str:
    """7 -> 8: a VM's units may be runs; with every lease ended no VM's block is left, and
    the lenders' lent entries and the nodes' extents stay as they are (blocks, as before)."""
    return "no record changes (a VM's window segments may be one run from now on)"


def _same_records(_tx: EtcdTxn) -> str:
    """1 -> 2: the version was SQLite's schema's then; its version 2 changed SQLite alone."""
    return "no record changes (layout 2 differs from 1 in SQLite only)"


#: The layout a step that installs a topology brings a cluster to at most (its pieces'
#: format is layout 4's); the steps after it convert other records.
TOPOLOGY_LAYOUT = 4

#: Per stored version, the step that brings it to the next one.
STEPS: dict[int, Callable[[EtcdTxn], str]] = {
    1: _same_records,
    2: _topology_in_generations,
    3: _generation_read_in_chunks,
    4: _holds_in_units,
    5: _own_places_decided,
    6: _lent_entries_of_lenders,
    7: _runs_of_units,
}


def _step_body(found: int, step: Callable[[EtcdTxn], str], where: str) -> Callable[[StateTxn], str]:
    """The transaction of one step from layout ``found``: refused while an agent's lease
    lives, nothing done when another upgrade moved the version on (""), the step's target
    version written last."""

    def body(state: StateTxn) -> str:
        tx = cast(EtcdTxn, state)
        now = tx.meta("schema_version")
        if now is None or now != str(found):  # another upgrade got there first
            return ""
        _refuse_live_agents(tx, where)
        what = step(tx)
        # a step that installs a topology writes this vmlend's layout with it (2 -> 3 writes
        # a generation of format 2: layout 4); never lower what it wrote, but never past the
        # layout of the topology's format: later steps convert other records
        wrote = tx.meta("schema_version")
        written = int(wrote) if wrote and wrote.isdigit() else 0
        target = max(found + 1, min(written, TOPOLOGY_LAYOUT))
        tx.set_meta("schema_version", str(target))
        return what

    return body


def upgrade(registry: EtcdRegistry) -> UpgradeResult:
    """Upgrade the layout of ``registry`` step by step to ``ETCD_SCHEMA_VERSION``;
    ``StateError`` (nothing written by the refused step) while an agent's lease lives, for a
    layout newer than this vmlend's, or for a version no step starts from."""
    where = registry.where
    with registry.read() as tx:
        raw = tx.meta("schema_version")
    if raw is None:
        raise StateError(
            f"no vmlend state in {where}; run 'vmlend fabric init' with this --registry first"
        )
    before = version = check_schema(raw, where)
    done: list[str] = []
    if version == ETCD_SCHEMA_VERSION:
        return UpgradeResult(where, before, version, done)
    with registry.read() as tx:
        _refuse_live_agents(cast(EtcdTxn, tx), where)
    while version < ETCD_SCHEMA_VERSION:
        step = STEPS.get(version)
        if step is None:
            raise StateError(
                f"the vmlend state in {where} has layout version {version}, which this vmlend"
                f" cannot upgrade (it upgrades from {min(STEPS)} on)"
            )
        target = version + 1
        what = registry.transact(_step_body(version, step, where))
        with registry.read() as tx:
            raw = tx.meta("schema_version")
        reached = check_schema(raw or str(target), where)
        if what:
            done.append(f"{version} -> {reached}: {what}")
        version = reached
    return UpgradeResult(where, before, version, done)
