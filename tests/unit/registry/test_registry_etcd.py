"""The etcd registry on a real etcd: optimistic transactions that re-run on conflict, where
keys live, selection by URL, and one clear line for each way etcd can fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.etcd_daemon import free_port, host_lease
from tests.support.simfabric import make_fabric, star_topology
from vmlend.cli import main
from vmlend.errors import ConfigError, DeviceHeldError, StateError, UnknownDeviceError
from vmlend.hook.install import install_hook
from vmlend.hostenv import HostEnv
from vmlend.registry import (
    EtcdRegistry,
    RegistryLocation,
    TopologyRecord,
    create_registry,
    open_registry,
    parse_location,
)
from vmlend.registry.etcd_gateway import Endpoint, EtcdGateway
from vmlend.registry.etcd_keys import is_extent, lent_share
from vmlend.topology.model import DeviceState, GiB, Holder
from vmlend.wiring.fabric import init_fabric, open_fabric

VM1 = Holder("gamma", "vm1", "11111111-1111-1111-1111-111111111111")
VM2 = Holder("beta", "vm2", "22222222-2222-2222-2222-222222222222")


def _fill(tx):
    tx.replace_topology(TopologyRecord("t", "src", "text", "d", "", 0.0), ["gamma"], [])


# --- selection -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "etcd://10.0.0.1:2379/lab",
            RegistryLocation(endpoints=(Endpoint("10.0.0.1", 2379),), cluster="lab"),
        ),
        (
            "etcd://a:1,b,[::1]:3/c-1",
            RegistryLocation(
                endpoints=(Endpoint("a", 1), Endpoint("b", 2379), Endpoint("::1", 3)), cluster="c-1"
            ),
        ),
        (
            "sqlite:///var/lib/vmlend/state.db",
            RegistryLocation(path=Path("/var/lib/vmlend/state.db")),
        ),
        ("state.db", RegistryLocation(path=Path("state.db"))),
    ],
)
def test_registry_locations_parse(text, expected):
    assert parse_location(text) == expected


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("etcd://10.0.0.1:2379", "needs one cluster name"),
        ("etcd://10.0.0.1:2379/", "needs one cluster name"),
        ("etcd://10.0.0.1:2379/a/b", "needs one cluster name"),
        ("etcd://host:99999/lab", "bad etcd port"),
        ("etcd://ho st:1/lab", "bad etcd endpoint"),
        ("etcd://h/../x", "needs one cluster name"),
        ("etcd://h/bad name", "bad cluster name"),
        ("http://h:2379/lab", "unknown registry URL"),
        ("sqlite://", "names no file"),
    ],
)
def test_bad_registry_locations_are_one_clear_line(text, what):
    with pytest.raises(ConfigError, match=what) as e:
        parse_location(text)
    assert "\n" not in str(e.value)


# --- optimistic transactions ---------------------------------------------------------------
def test_a_body_reruns_when_another_host_changed_what_it_read(etcd_url):
    create_registry(etcd_url, _fill).close()
    mine, theirs = open_registry(etcd_url), open_registry(etcd_url)
    seen = []

    def body(tx):
        seen.append(tx.meta("counter"))
        if len(seen) == 1:  # another host commits between our read and our commit
            theirs.transact(lambda t: t.set_meta("counter", "1"))
        tx.set_meta("counter", str(int(tx.meta("counter") or 0) + 10))

    mine.transact(body)
    assert seen == [None, "1"]
    with mine.read() as tx:
        assert tx.meta("counter") == "11"  # not 10: the lost update was prevented


def test_a_new_claim_under_an_adapter_it_read_does_not_rerun_the_body(etcd_url):
    """Claims are read without a prefix compare: what keeps two reserves from overcommitting
    an adapter is the unit keys each creates (tests/test_registry_units.py), so another VM's
    reserve on the adapter does not make this body run again."""
    make_fabric(etcd_url).close()
    mine = open_registry(etcd_url)
    other = open_fabric(etcd_url, "beta")
    runs = []

    def body(tx):
        runs.append(len(tx.claims_on(["alpha:0"])))
        if len(runs) == 1:
            other.reserve(0x11, VM2)  # claims on alpha:0 appear after our read
        tx.set_meta("seen", str(runs[-1]))

    mine.transact(body)
    assert runs == [0]


def test_endless_conflicts_stop_after_bounded_retries_with_one_line(etcd_url):
    create_registry(etcd_url, _fill).close()
    gw = EtcdGateway(parse_location(etcd_url).endpoints)
    mine = EtcdRegistry(gw, parse_location(etcd_url).cluster, attempts=4, sleep=lambda s: None)
    theirs = open_registry(etcd_url)
    runs = []

    def body(tx):
        runs.append(tx.meta("x"))
        theirs.transact(lambda t: t.set_meta("x", str(len(runs))))
        tx.set_meta("x", "mine")

    with pytest.raises(StateError, match=r"kept changing .*4 attempts.*nothing was written"):
        mine.transact(body)
    assert len(runs) == 4
    with theirs.read() as tx:
        assert tx.meta("x") == "4"


def test_concurrent_reserve_of_one_device_from_two_hosts(etcd_url):
    make_fabric(etcd_url).close()
    gamma, beta = open_fabric(etcd_url, "gamma"), open_fabric(etcd_url, "beta")
    gamma.reserve(0x10, VM1)
    with pytest.raises(DeviceHeldError, match="gamma/vm1"):
        beta.reserve(0x10, VM2)
    assert beta.device(0x10).holder == VM1


# --- layout -----------------------------------------------------------------------------------
def test_records_live_one_per_key_under_the_cluster_prefix(etcd, etcd_url):
    fabric = make_fabric(etcd_url)
    fabric.reserve(0x10, VM1)
    cluster = parse_location(etcd_url).cluster
    gw = EtcdGateway([Endpoint("127.0.0.1", etcd.client_port)])
    _rev, kvs = gw.range("/vmlend/", "/vmlend0")
    keys = {kv.key.removeprefix(f"/vmlend/{cluster}/") for kv in kvs if cluster in kv.key}
    assert "holds/0x10" in keys and "topology/digest" in keys
    # the claims, on the unit blocks of each adapter of the path (layout 5)
    assert any(k.startswith("units/alpha:0/lut-blocks/") for k in keys)
    assert any(k.startswith("units/gamma:0/lut-blocks/") for k in keys)
    # a switch port's requester entry, under the port's name
    assert any(k.startswith("units/mxs824/gamma:0/lut-blocks/") for k in keys)
    assert not [k for k in keys if k.startswith(("claims/", "held-on/"))]  # layout 4's
    # every device as the topology says but 0x10's, whose record lists its lent entries
    # (its requester entry on alpha's adapter and on the port toward it: layout 7)
    assert {k for k in keys if k.startswith("devices/")} == {"devices/0x10"}
    assert any(k.startswith("units/mxs824/alpha:0/lut-blocks/") for k in keys)
    # gamma's own places (its adapter, the switch port toward it) are its node's extents,
    # and its decider's epoch and extents keys list them (layout 6); none is the VM's
    assert {"decider/gamma/epoch", "decider/gamma/extents"} <= keys
    fabric.release(0x10, VM1)
    gammas = ("gamma:0", "mxs824/gamma:0")
    for gone in ("units/", "held-vm/", "holds/"):  # with its last hold, the VM's marker too
        _rev, kvs = gw.range(f"/vmlend/{cluster}/{gone}", f"/vmlend/{cluster}/{gone[:-1]}0")
        # what stays: gamma's extents, which its decider keeps for its next VMs, and
        # alpha's lent entries for 0x10, while it lends it
        left = [kv.key for kv in kvs if not is_extent(kv.value) and not lent_share(kv.value)]
        assert left == [], gone
        places = (*gammas, "alpha:0", "mxs824/alpha:0")
        assert all(
            kv.key.startswith(tuple(f"/vmlend/{cluster}/units/{a}/" for a in places)) for kv in kvs
        ), gone


def test_a_fabric_bigger_than_one_etcd_transaction_initialises(etcd_url):
    text = star_topology(4, 300)  # 300 devices: more keys than etcd's 128 ops per Txn
    init_fabric(etcd_url, text, "big.toml")
    with open_fabric(etcd_url, "h1") as f:
        assert len(f.devices()) == 300
        f.unlend(0x101)
        f.reserve(0x102, Holder("h1", "vm"))
        states = {d.fdid: d.state for d in f.devices()}
    assert states[0x101] is DeviceState.UNLENT and states[0x102] is DeviceState.RESERVED


def test_host_identity_never_comes_from_the_cluster_registry(etcd_url):
    init_fabric(etcd_url, star_topology(2, 1), "star.toml", node="h0")
    with pytest.raises(ConfigError, match="--node, VMLEND_NODE or the file etc/vmlend/node"):
        open_fabric(etcd_url)
    assert open_fabric(etcd_url, "h1").local_node == "h1"


def test_host_identity_from_the_host_roots_config_file(etcd_url, tmp_path):
    init_fabric(etcd_url, star_topology(2, 1), "star.toml")
    root = tmp_path / "host-h0"
    (root / "etc" / "vmlend").mkdir(parents=True)
    (root / "etc" / "vmlend" / "node").write_text("h0\n")
    assert open_fabric(etcd_url, root=root).local_node == "h0"
    assert open_fabric(etcd_url, "h1", root=root).local_node == "h1"  # --node wins


# --- failures: one clear line each, nothing half-done -------------------------------------------
def test_no_state_in_etcd_says_to_init(etcd_url):
    with pytest.raises(StateError, match=r"no vmlend state in etcd://.*run 'vmlend fabric init'"):
        open_registry(etcd_url)


def test_unreachable_etcd_is_one_clear_line():
    url = f"etcd://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/lab"
    with pytest.raises(StateError, match=r"cannot reach etcd at 127.0.0.1:\d+,127.0.0.1:\d+") as e:
        open_registry(url)
    assert "\n" not in str(e.value) and "start etcd" in str(e.value)


def test_a_transaction_with_too_many_operations_writes_nothing(etcd_url):
    fabric = make_fabric(etcd_url)
    fabric.reserve(0x10, VM1)
    reg = open_registry(etcd_url)

    def many(tx):
        for i in range(200):
            tx.put_runtime(0x10, "test", str(i), {})

    with pytest.raises(StateError, match=r"too many operations.*nothing was written"):
        reg.transact(many)
    with reg.read() as tx:
        assert tx.runtime(0x10) == []


def test_a_request_too_large_writes_nothing(etcd_url):
    fabric = make_fabric(etcd_url)
    fabric.reserve(0x10, VM1)
    reg = open_registry(etcd_url)
    blob = "x" * (1600 << 10)  # over etcd's 1.5 MiB per request
    with pytest.raises(StateError, match=r"too large.*nothing was written"):
        reg.transact(lambda tx: tx.put_runtime(0x10, "big", "x", {"blob": blob}))
    with pytest.raises(StateError, match=r"too large.*nothing was written"):  # the gateway's 2 MiB
        reg.transact(lambda tx: tx.put_runtime(0x10, "big", "x", {"blob": blob * 2}))
    with reg.read() as tx:
        assert tx.runtime(0x10) == []


def test_etcd_stopped_mid_operation_then_restarted(private_etcd, tmp_path, monkeypatch):
    host_lease(private_etcd, tmp_path / "host")
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "host"))
    url = private_etcd.url("restart")
    fabric = make_fabric(url)
    fabric.reserve(0x10, VM1)
    private_etcd.stop()
    with pytest.raises(StateError, match="cannot reach etcd"):
        fabric.reserve(0x11, VM1)
    with pytest.raises(StateError, match="cannot reach etcd"):
        fabric.release(0x10, VM1)
    private_etcd.start()
    # Nothing half-done: the hold that was there is there, the refused ones never happened.
    states = {d.fdid: (d.state, d.holder) for d in fabric.devices()}
    assert states[0x10] == (DeviceState.RESERVED, VM1)
    assert states[0x11] == (DeviceState.AVAILABLE, None)
    assert fabric.release(0x10, VM1) is True
    fabric.reserve(0x11, VM1)


# --- the CLI and the hook on etcd ----------------------------------------------------------------
def test_cli_commands_work_on_an_etcd_registry(etcd_url, monkeypatch, tmp_path):
    monkeypatch.setenv("VMLEND_STATE", str(tmp_path / "unused.db"))
    monkeypatch.delenv("VMLEND_NODE", raising=False)

    def run(*args):
        return CliRunner().invoke(main, ["--registry", etcd_url, *args])

    r = run("fabric", "init")
    assert r.exit_code == 0 and "each host names its node" in r.output, r.output
    r = run("--node", "gamma", "devices")
    assert r.exit_code == 0 and "0x10" in r.output, r.output
    r = run("devices")  # reading needs no node identity
    assert r.exit_code == 0 and "0x10" in r.output, r.output
    r = run("unlend", "0x10")  # writing does
    assert r.exit_code == 1 and "--node, VMLEND_NODE or the file etc/vmlend/node" in r.output
    assert not (tmp_path / "unused.db").exists()


def test_hook_install_pins_the_registry_url(etcd_url, tmp_path):
    from vmlend.hook.install import read_pins

    result = install_hook(
        tmp_path / "libvirt",
        HostEnv.from_env().root / "s.db",  # what the file pins lies under the host root
        "gamma",
        interpreter=sys.executable,
        registry=etcd_url,
    )
    # the hook pins its configuration file, which holds the URL
    assert read_pins(result.path.read_text())["registry"] == etcd_url
    config = tmp_path / "vmlend" / "vmlend.toml"
    assert f'registry = "{etcd_url}"' in config.read_text()


def test_cold_migration_moves_the_holds_through_the_etcd_registry(etcd_url, tmp_path, monkeypatch):
    import uuid

    from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
    from vmlend.topology.model import MiB
    from vmlend.wiring.hypervisor import hook_command, open_hypervisor

    make_fabric(etcd_url).close()
    local = tmp_path / "local"
    monkeypatch.setenv("VMLEND_STATE", str(local / "state.db"))
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    spec = DomainSpec(
        name="vm1",
        memory_bytes=512 * MiB,
        virt_type="qemu",
        uuid=uuid.uuid4(),
        devices=[DeviceRequest(0x10), DeviceRequest(0x20)],
    )
    gamma = open_hypervisor(
        "sim:///gamma", state_dir=local, hook_command=hook_command(etcd_url, "gamma")
    )
    gamma.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    gamma.start("vm1")  # gamma's prepare hook reserves both in etcd

    def holders(node: str) -> dict[int, str]:
        with open_fabric(etcd_url, node) as f:
            return {d.fdid: str(d.holder) for d in f.devices() if d.holder}

    assert holders("beta") == {0x10: "gamma/vm1", 0x20: "gamma/vm1"}
    r = CliRunner().invoke(
        main,
        [
            "--registry",
            etcd_url,
            "migrate",
            "vm1",
            "--to",
            "alpha",
            "--start",
            "-c",
            "sim:///gamma",
        ],
    )
    assert r.exit_code == 0, r.output
    # Every host reads the same truth: the VM holds its devices from alpha now.
    assert (
        holders("alpha")
        == holders("beta")
        == holders("gamma")
        == {
            0x10: "alpha/vm1",
            0x20: "alpha/vm1",
        }
    )


def test_the_hook_fails_a_vm_start_cleanly_when_etcd_is_unreachable(tmp_path):
    import io
    import uuid

    from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
    from vmlend.hook.main import run as run_hook
    from vmlend.topology.model import MiB

    spec = DomainSpec(
        name="vm1", memory_bytes=512 * MiB, uuid=uuid.uuid4(), devices=[DeviceRequest(0x10)]
    )
    err = io.StringIO()
    code = run_hook(
        ["vm1", "prepare", "begin", "-"],
        stdin=io.BytesIO(new_domain(spec, templates=TemplateSet()).to_bytes()),
        stdout=io.BytesIO(),
        stderr=err,
        environ={
            "VMLEND_REGISTRY": f"etcd://127.0.0.1:{free_port()}/lab",
            "VMLEND_NODE": "gamma",
            "VMLEND_STATE": str(tmp_path / "state.db"),
        },
    )
    lines = err.getvalue().strip().splitlines()
    assert code == 1 and len(lines) == 1, err.getvalue()
    assert "cannot reach etcd at 127.0.0.1:" in lines[0] and "Traceback" not in lines[0]


def _small_and_large_fabrics(etcd_url):
    """Seen from h1: a 4-node star with 5 devices per node and no holds, then one with 60 times
    more devices and 25 holds."""
    for name, devices, held in (("small", 5, 0), ("large", 300, 25)):
        url = f"{etcd_url}-{name}"
        init_fabric(url, star_topology(4, devices), "star.toml")
        with open_fabric(url, "h1") as f:
            for i in range(held):
                f.reserve(0x100 + devices - 1 - i, Holder(f"h{i % 4}", f"vm{i}"))
            yield f


def test_a_reserve_costs_the_same_few_requests_however_big_the_fabric(etcd_url, etcd_requests):
    """A reserve reads what it decides on in one request and commits in a second, on a small
    fabric and on a fabric with 60 times more devices and many holds, a VM's first as its
    later ones (its marker, which lists its holds, is read with the rest, absent or not:
    before layout 5 a VM's first reserve also read its node's index of holds)."""
    counts = []
    for f in _small_and_large_fabrics(etcd_url):
        probe = Holder("h1", "probe")
        etcd_requests.clear()
        f.reserve(0x101, probe)
        first = len(etcd_requests)
        f.release(0x101, probe)
        etcd_requests.clear()
        f.reserve(0x100, probe)
        counts.append((first, len(etcd_requests)))
    assert counts[0] == counts[1] == (2, 2)


def test_a_release_costs_the_same_few_requests_however_big_the_fabric(etcd_url, etcd_requests):
    """A release without hardware in its process (the hook, the CLI) reads everything the
    state change needs in one request and commits in a second: two requests (a reserve and
    release cycle, four), on a small fabric and on one with 60 times more devices and many
    holds and mdevs. (With hardware it first reads its hold, to give the hardware back.)"""
    counts = []
    for f in _small_and_large_fabrics(etcd_url):
        probe = Holder("h1", "probe")
        f.reserve(0x100, probe)
        etcd_requests.clear()
        assert f.release(0x100, probe) is True
        counts.append(len(etcd_requests))
        assert f.device(0x100).holder is None
    assert counts[0] == counts[1] <= 2


def test_a_reserve_and_release_cycle_with_guest_ram_costs_four_requests_then_two(
    etcd_url, etcd_requests
):
    """The cycle ``bench/bench_cluster.py`` times, with DMA windows (units of several
    segments taken and given back): the first time two requests each way, as a bare read and
    Txn; then, the cluster unchanged, one each way (what the commits knew is remembered:
    ``etcd_warm``)."""
    with make_fabric(etcd_url) as f:
        holder = Holder("gamma", "probe")
        f.reserve(0x10, holder, guest_ram=16 * GiB)  # the topology is read once
        f.release(0x10, holder)
        f.registry.forget()  # as a process that committed nothing yet
        etcd_requests.clear()
        counts = []
        for _ in range(2):
            f.reserve(0x10, holder, guest_ram=16 * GiB)
            reserved = len(etcd_requests)
            assert f.release(0x10, holder)
            counts.append((reserved, len(etcd_requests)))
            etcd_requests.clear()
    assert counts == [(2, 4), (1, 2)]


def test_a_warm_cycle_does_not_compare_the_topology_head(etcd_url, monkeypatch):
    """What a reserve and a release compare is what they decide on: once the process knows the
    topology, its digest (compared) names it. Each compare is an operation etcd evaluates at
    every commit (``bench/bench_cluster.py``, "what it sends"); the head cost a read and a
    compare in each of the cycle's four requests."""
    from vmlend.registry.etcd_gateway import b64
    from vmlend.registry.etcd_keys import Keys

    sent: list[dict] = []
    real_call = EtcdGateway.call

    def recording(self, path, body):
        sent.append(body)
        return real_call(self, path, body)

    keys = Keys(etcd_url.rsplit("/", 1)[1])
    unwanted = {b64(keys.topology_head)}
    with make_fabric(etcd_url) as f:
        holder = Holder("gamma", "probe")
        f.reserve(0x10, holder)  # warm: the topology is read once
        f.release(0x10, holder)
        monkeypatch.setattr(EtcdGateway, "call", recording)
        f.reserve(0x10, holder)
        assert f.release(0x10, holder)
    read = {op["request_range"]["key"] for b in sent for op in b.get("success", [])
            if "request_range" in op}  # fmt: skip
    compared = {c["key"] for b in sent for c in b.get("compare", [])}
    assert not (read | compared) & unwanted
    assert b64(keys.topology_digest) in compared


def test_a_topology_installed_by_another_process_is_read_by_a_warm_one(etcd_url):
    """The head is not read once a process knows the topology, so a new topology must reach
    it through the digest: installed by another process, it is what the next reserve
    decides on (here one without device 0x10)."""
    with make_fabric(etcd_url) as f:
        holder = Holder("gamma", "probe")
        f.reserve(0x10, holder)
        assert f.release(0x10, holder)
        text = star_topology(2, 2)  # no device 0x10
        assert init_fabric(etcd_url, text, "star.toml", replace=True).action == "replaced"
        with pytest.raises(UnknownDeviceError):  # the new topology's answer, not the old one's
            f.reserve(0x10, holder)
        with f.registry.read() as tx:
            assert tx.device(0x10) is None
            assert tx.topology().text == text


def test_a_hold_handed_over_goes_on_the_destination_hosts_lease(etcd, etcd_url, tmp_path):
    """A hot migration's hand-over re-makes the hold under its key: the destination's hold
    and its VM's marker go on the destination host's lease. Before, the hold and
    the claims kept the source's lease (a rewritten key keeps its lease), so stopping the
    source's agent after moving its VMs away ended the destination's hold with it. Its unit
    blocks too: the blocks it gives back are taken again, put over their own keys."""
    from vmlend.ledger import handover
    from vmlend.registry.etcd_gateway import prefix_end
    from vmlend.registry.etcd_keys import Keys

    fabric = make_fabric(etcd_url)  # gamma's, on the test host's lease
    dst = Holder("beta", VM1.vm, VM1.vm_uuid)
    fabric.reserve(0x10, VM1, guest_ram=GiB)
    loc = parse_location(etcd_url)
    assert isinstance(loc, RegistryLocation)
    gw, keys = EtcdGateway(loc.endpoints), Keys(loc.cluster)

    def leases(prefix: str) -> set[int]:
        _rev, kvs = gw.range(prefix, prefix_end(prefix))
        assert kvs, prefix
        return {kv.lease for kv in kvs}

    source = leases(keys.hold(0x10))
    beta = host_lease(etcd, tmp_path / "beta-host", "beta")
    assert beta not in source
    there = EtcdRegistry.open(EtcdGateway(loc.endpoints), loc.cluster, host_lease=lambda: beta)
    claimed = handover.claim_destination(fabric.registry, [0x10], VM1, dst, GiB)
    handover.hand_over(there, claimed, {}, 0.0)
    assert leases(keys.hold(0x10)) == {beta}
    assert leases(keys.vm_holds("beta", VM1.vm)) == {beta}
    # and so do its unit blocks, which carry its claims: those it gave back and took again
    # in the same transaction (gamma's own extents stay there, on no lease: gamma's, and
    # alpha's lent entry, alpha's)
    for a in ("alpha:0", "gamma:0"):
        _rev, kvs = gw.range(keys.units_of(a), prefix_end(keys.units_of(a)))
        mine = [kv for kv in kvs if not is_extent(kv.value) and not lent_share(kv.value)]
        assert {kv.lease for kv in mine} == {beta}, a
        assert {kv.lease for kv in kvs if kv not in mine} <= {0}, a
    gw.close()
