"""The topology in etcd as generations of pieces, on a real etcd with its default limits (1.5
MiB and 128 operations per request): a fabric too large for one request initialises, readers
see one whole generation, racing installs leave one, and old ones are deleted."""

from __future__ import annotations

import threading

import pytest

from tests.support.older_state import etcd_before_generations
from tests.support.simfabric import fabric_topology, small_topology, star_topology
from vmlend.errors import StateError, StateRecordError
from vmlend.hostenv import HostEnv
from vmlend.registry import open_registry
from vmlend.registry.etcd_gateway import b64, prefix_end
from vmlend.registry.etcd_topology import EtcdTopology
from vmlend.registry.schema import ETCD_SCHEMA_VERSION
from vmlend.registry.topopieces import decode_head
from vmlend.wiring.fabric import default_topology_text, init_fabric, open_fabric


def _generations(url: str) -> dict[str, int]:
    """Each generation under ``topology/gen/`` and how many keys it has."""
    with open_registry(url) as reg:
        base = reg.keys.topology_generations
        _rev, kvs = reg.gateway.range(base, prefix_end(base))
    out: dict[str, int] = {}
    for kv in kvs:
        generation = kv.key[len(base) :].split("/", 1)[0]
        out[generation] = out.get(generation, 0) + 1
    return out


def _head(url: str):
    with open_registry(url) as reg:
        _rev, kvs = reg.gateway.range(reg.keys.topology_head)
        return decode_head(kvs[0].value, "head")


def _text(url: str) -> str:
    with open_registry(url) as reg, reg.read() as tx:
        return tx.topology().text


def test_a_fabric_over_one_requests_limit_initialises_on_a_default_etcd(etcd_url):
    # 256 nodes x 16 devices: TOML and compiled form ~1.6 MB, over the default 1.5 MiB that
    # refused the single topology record
    text = fabric_topology(256, 16)
    assert init_fabric(etcd_url, text, "big.toml").action == "created"
    head = _head(etcd_url)
    assert head.pieces >= 3 and _generations(etcd_url) == {head.generation: head.pieces + 1}
    with open_fabric(etcd_url, "n0") as fabric:
        assert len(fabric.devices()) == 256 * 16
        assert fabric.device(0x100 * 256 + 15).spec.lender == "n255"
    assert _text(etcd_url) == text


def test_replacing_deletes_the_old_generation_and_the_record_of_before(etcd_url):
    """Layout 2 kept the topology in one record: refused until upgraded (layout 5 does not
    read its holds), which moves it into a generation; each replacement deletes the
    generation before it."""
    from vmlend.registry.upgrade import upgrade

    text, source = default_topology_text()
    etcd_before_generations(etcd_url, text, source)  # schema 2: one record, no head
    with pytest.raises(StateError, match=r"has layout 2.*'vmlend registry upgrade'"):
        open_fabric(etcd_url, "gamma")
    with open_registry(etcd_url, upgrading=True) as reg:
        assert upgrade(reg).after == ETCD_SCHEMA_VERSION  # type: ignore[arg-type]
    with open_fabric(etcd_url, "gamma") as fabric:
        assert len(fabric.devices()) == 9
    for topology in (small_topology(), star_topology(2, 2), text):
        assert init_fabric(etcd_url, topology, "t.toml", replace=True).action == "replaced"
        head = _head(etcd_url)
        assert _generations(etcd_url) == {head.generation: head.pieces + 1}
        assert _text(etcd_url) == topology
    with open_registry(etcd_url) as reg:
        assert reg.gateway.range(reg.keys.topology_record)[1] == []
        with reg.read() as tx:
            assert tx.meta("schema_version") == str(ETCD_SCHEMA_VERSION) == "8"


def test_a_transaction_that_does_not_commit_deletes_the_generation_it_wrote(etcd_url):
    init_fabric(etcd_url, small_topology(), "t.toml")
    before = _generations(etcd_url)

    def install_then_fail(tx):
        tx.set_topology_compiled(b"whatever")
        raise RuntimeError("boom")

    with open_registry(etcd_url) as reg, pytest.raises(RuntimeError):
        reg.transact(install_then_fail)
    assert _generations(etcd_url) == before


def test_a_racing_install_leaves_one_whole_generation_never_a_mix(etcd_url, monkeypatch):
    """A stages its generation; before it switches, B installs another one (staging,
    switching, deleting every generation but its own: A's too). A's switch then fails its
    compares, A runs again and installs its topology: one whole generation is left."""
    init_fabric(etcd_url, small_topology(), "first.toml")
    a_text, b_text = star_topology(2, 2), default_topology_text()[0]
    real_stage = EtcdTopology.stage
    staged: list[str] = []

    def stage(self, stored):
        done = real_stage(self, stored)
        staged.append(done.head.generation)
        if len(staged) == 1:  # A's first staging: B runs its whole install now
            assert init_fabric(etcd_url, b_text, "b.toml", replace=True).action == "replaced"
            assert done.head.generation not in _generations(etcd_url)  # collected by B
        return done

    monkeypatch.setattr(EtcdTopology, "stage", stage)
    assert init_fabric(etcd_url, a_text, "a.toml", replace=True).action == "replaced"
    assert len(staged) == 3  # A, B, A again
    head = _head(etcd_url)
    assert head.generation == staged[2]
    assert _generations(etcd_url) == {head.generation: head.pieces + 1}
    assert _text(etcd_url) == a_text


def test_installs_racing_in_threads_leave_one_generation_of_one_of_them(etcd_url):
    init_fabric(etcd_url, small_topology(), "first.toml")
    texts = [star_topology(2, 2), default_topology_text()[0]]
    errors: list[BaseException] = []

    def install(text: str) -> None:
        try:
            for _ in range(3):
                init_fabric(etcd_url, text, "t.toml", replace=True)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=install, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    head = _head(etcd_url)
    assert _generations(etcd_url) == {head.generation: head.pieces + 1}
    assert _text(etcd_url) in texts


def test_a_head_naming_lost_pieces_is_one_record_error(etcd_url):
    init_fabric(etcd_url, small_topology(), "t.toml")
    head = _head(etcd_url)
    with open_registry(etcd_url) as reg:
        piece = reg.keys.topology_piece(head.generation, 0)
        reg.gateway.txn([], [{"request_delete_range": {"key": b64(piece)}}])
    for path in HostEnv.from_env().topology_cache.iterdir():  # no host's copy to fall back on
        path.unlink()
    with pytest.raises(StateRecordError, match=r"pieces found.*fabric init --replace"):
        open_fabric(etcd_url, "b")
