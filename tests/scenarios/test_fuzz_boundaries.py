"""Fuzzing every boundary where root's vmlend reads what someone else wrote (issue 21).

One property everywhere: the input is taken (exit 0, or a value that is what it should be),
or refused with exit 1 or 2 and the error on one line (one ``VmlendError`` for a library
boundary, a ``WireError`` for the hook socket's frames): no traceback, no "internal error",
and nothing changed. The boundaries: sysfs attributes under a fake root, domain XML into the
hook and into the CLI, topology TOML into ``fabric init``, CLI arguments, and the frames of
the agent's hook socket, the configuration file the CLI and the hook share, the plug requests
any writer of the registry can leave for an agent, and the agent's metrics endpoint.

Derandomized and without an example database, so CI runs the same examples every time;
``VMLEND_FUZZ_EXAMPLES`` (default 100 per boundary) explores more.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import event, given
from hypothesis import strategies as st

from tests.support.fake_sysfs import FakeSmartio, FakeSysfs, FakeType, populate_smartio
from tests.support.fuzz_support import (
    CONFIG_KINDS,
    assert_clean_failure,
    assert_cli_result,
    byte_op,
    config_plan,
    copy_state,
    dump_state,
    fuzz_settings,
    mutate_config,
    mutate_toml,
    mutate_xml,
    nasty_text,
    toml_plan,
    xml_plan,
)
from tests.support.simfabric import make_fabric
from tests.support.sysfs_damage import (
    SMARTIO_ATTRIBUTES,
    plant_bytes,
    plant_directory,
    plant_fifo,
    plant_loop,
)
from vmlend.cli import main
from vmlend.cli.config import load_default_map
from vmlend.config import MAX_CONFIG_BYTES, hook_environment
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.errors import SysfsAttributeError, VmlendError
from vmlend.hook import wire
from vmlend.hook.main import run
from vmlend.kernel.backend import open_smartio_fabric
from vmlend.kernel.driver import SmartioDriver
from vmlend.kernel.mdev import MdevBus
from vmlend.topology.model import BarKind, MiB
from vmlend.topology.parse import MAX_ADDRESS
from vmlend.wiring.fabric import default_topology_text, open_fabric

VM_UUID = uuid.UUID("6f1c5a2e-0000-4000-8000-000000000001")


def vmlend_domain(fdids: tuple[int, ...] = (0x10, 0x12)) -> bytes:
    spec = DomainSpec(
        name="vm1",
        memory_bytes=512 * MiB,
        uuid=VM_UUID,
        devices=[DeviceRequest(f) for f in fdids],
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    # Module-scoped: hypothesis runs many examples per test, each resets what it uses.
    d = Path(tempfile.mkdtemp(prefix="vmlend-fuzz-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def pristine(workdir) -> Path:
    """The default cluster's state, never changed: every example starts from a copy."""
    path = workdir / "pristine" / "state.db"
    path.parent.mkdir()
    make_fabric(path).close()
    return path


@pytest.fixture
def state(pristine, tmp_path) -> Path:
    path = tmp_path / "state" / "state.db"
    path.parent.mkdir()
    copy_state(pristine, path)
    return path


# --- 1. sysfs attributes under a fake root ---------------------------------------------------

GOOD_BARS = "0 0x1000000 mem32\n1 0x800000000 mem64 prefetch\n"

bar_line = st.tuples(
    st.integers(-2, 7),
    st.one_of(
        st.sampled_from([0, 1, 4, 16, 0x3000, 1 << 31, 1 << 32, MAX_ADDRESS, 1 << 104]),
        st.integers(-(1 << 70), 1 << 70),
    ),
    st.sampled_from(["mem32", "mem64", "io", "mem16", ""]),
    st.sampled_from(["", " prefetch", " cached"]),
).map(lambda t: f"{t[0]} {t[1]:#x} {t[2]}{t[3]}" if t[1] >= 0 else f"{t[0]} {t[1]} {t[2]}{t[3]}")

damage = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=64)),
    st.tuples(st.just("bytes"), nasty_text.map(lambda s: (s + "\n").encode("utf-8", "replace"))),
    st.tuples(
        st.just("bytes"), st.lists(bar_line, max_size=4).map(lambda x: "\n".join(x).encode())
    ),
    st.tuples(st.sampled_from(["dir", "loop", "fifo", "missing"]), st.just(b"")),
)


def plant(path: Path, how: str, data: bytes) -> None:
    if how == "bytes":
        plant_bytes(path, data)
    elif how == "dir":
        plant_directory(path)
    elif how == "loop":
        plant_loop(path)
    elif how == "fifo":
        plant_fifo(path)
    else:
        plant_bytes(path, b"")
        path.unlink()


def assert_sound(dev) -> None:
    """What the driver accepted is what the kernel can report."""
    assert 32 <= dev.dma_bits <= 64
    assert 0 <= dev.vendor_id <= 0xFFFF and 0 <= dev.device_id <= 0xFFFF
    assert 0 <= dev.class_code <= 0xFFFFFF and 1 <= dev.lender_node_id <= 0xFFFF
    assert dev.physfn is None or (0 <= dev.physfn <= 0xFFFFFFFF and dev.physfn != dev.fdid)
    for b in dev.bars:
        assert 0 <= b.index <= 5 and b.size & (b.size - 1) == 0
        assert (4 if b.kind is BarKind.IO else 16) <= b.size <= MAX_ADDRESS


@pytest.fixture(scope="module")
def smartio_root(workdir) -> FakeSmartio:
    fake = FakeSysfs(workdir / "sysfs")
    smartio = FakeSmartio(fake, node_id=12)
    smartio.add_device(0x10, 4, class_code=0x030200, dma_bits=40, bars=GOOD_BARS)
    smartio.add_device(0x11, 4, bdf="0000:42:00.0")
    fake.add_parent("mtty", [FakeType("mtty-1", "one port", "a serial port", available=2)])
    fake.add_parent("good", [FakeType("good-1", available=1)])
    return smartio


def restore_device(smartio: FakeSmartio, fdid: int) -> Path:
    d = smartio.fake.env.smartio / f"smartio-{fdid:x}"
    dev = smartio.devs[fdid]
    for name in SMARTIO_ATTRIBUTES:
        text = {"bars": GOOD_BARS, "availability": dev.availability + "\n"}.get(name)
        plant_bytes(d / name, (text or f"{dev.attrs.get(name, dev.borrower)}\n").encode())
    return d


@fuzz_settings(scale=2)
@given(
    attacks=st.lists(st.tuples(st.sampled_from(SMARTIO_ATTRIBUTES), damage), min_size=1, max_size=3)
)
def test_sysfs_attributes_are_a_sound_device_or_one_typed_error(smartio_root, attacks):
    d = restore_device(smartio_root, 0x10)
    for name, (how, data) in attacks:
        plant(d / name, how, data)
    driver = SmartioDriver(smartio_root.fake.env, smartio_root.fake)
    try:
        assert_sound(driver.device(0x10))
        event("accepted")
    except SysfsAttributeError as e:
        event("refused")
        assert "\n" not in str(e) and str(d) in e.path
    found, damaged = driver.scan()
    assert 0x11 in [dev.fdid for dev in found]  # the sound neighbour is never hidden
    assert len(found) + len(damaged) == 2


MDEV_ATTRIBUTES = ("available_instances", "name", "description", "device_api")


@fuzz_settings()
@given(name=st.sampled_from(MDEV_ATTRIBUTES), attack=damage)
def test_mdev_type_attributes_are_a_sound_type_or_one_typed_error(smartio_root, name, attack):
    fake = smartio_root.fake
    tdir = fake.env.mdev_bus / "mtty" / "mdev_supported_types" / "mtty-1"
    for attr, text in zip(
        MDEV_ATTRIBUTES, ("2\n", "one port\n", "a serial port\n", "vfio-pci\n"), strict=True
    ):
        plant_bytes(tdir / attr, text.encode())
    plant(tdir / name, *attack)
    bus = MdevBus(fake.env, fake)
    try:
        t = bus.parent("mtty").type("mtty-1")
        assert 0 <= t.available_instances < 1 << 31
        assert all(c.isprintable() for c in t.name + t.device_api)
    except VmlendError as e:
        assert "\n" not in str(e)
    assert "good" in [p.name for p in bus.parents()]


@pytest.fixture(scope="module")
def kernel_host(workdir, pristine) -> tuple[FakeSysfs, dict[Path, bytes]]:
    """A fake host whose SmartIO driver lists the default cluster, and the sound bytes of
    every attribute of the two devices the next property damages."""
    fake = FakeSysfs(workdir / "kernel")
    with open_fabric(pristine) as sim:
        populate_smartio(FakeSmartio(fake, node_id=12), sim.topology())
    sound = {
        fake.env.smartio / f"smartio-{fdid:x}" / name: b""
        for fdid in (0x10, 0x12)
        for name in SMARTIO_ATTRIBUTES
    }
    return fake, {path: path.read_bytes() for path in sound}


@fuzz_settings()
@given(
    attacks=st.lists(
        st.tuples(st.sampled_from((0x10, 0x12)), st.sampled_from(SMARTIO_ATTRIBUTES), damage),
        min_size=1,
        max_size=2,
    )
)
def test_hostile_sysfs_under_the_hook_on_the_kernel_backend(
    pristine, kernel_host, tmp_path, attacks
):
    fake, sound = kernel_host
    for path, data in sound.items():
        plant_bytes(path, data)
    for fdid, name, (how, data) in attacks:
        plant(fake.env.smartio / f"smartio-{fdid:x}" / name, how, data)
    state = tmp_path / "kernel" / "state.db"
    state.parent.mkdir(exist_ok=True)
    copy_state(pristine, state)
    before = dump_state(state)
    xml = vmlend_domain()

    def on_this_host(path, node):
        return open_smartio_fabric(path, node, env=fake.env, writer=fake)

    def call(*argv: str) -> tuple[int, str]:
        err = io.StringIO()
        code = run(["vm1", *argv], stdin=io.BytesIO(xml), stdout=io.BytesIO(), stderr=err,
                   environ={"VMLEND_STATE": str(state)}, open_fabric=on_this_host)  # fmt: skip
        return code, err.getvalue()

    code, err = call("prepare", "begin", "-")
    event(f"prepare: exit {code}")
    assert code in (0, 1)
    assert_clean_failure(code, err)
    if code == 0:
        assert call("release", "end", "-") == (0, "")
    else:
        assert dump_state(state) == before
    # Nothing is left in the kernel either way: no child, no registered parent.
    assert MdevBus(fake.env, fake).devices() == [] and MdevBus(fake.env, fake).parents() == []


# --- 2. domain XML into the hook ---------------------------------------------------------------

HOOK_CALLS = (("prepare", "begin", "-"), ("release", "end", "-"), ("migrate", "begin", "-"))


def hook(state: Path, argv: list[str], xml: bytes) -> tuple[int, str]:
    out, err = io.BytesIO(), io.StringIO()
    code = run(argv, stdin=io.BytesIO(xml), stdout=out, stderr=err, environ={
        "VMLEND_STATE": str(state),
        "VMLEND_HOOK_SOCKET": str(state.parent / "no-agent.sock"),
    })  # fmt: skip
    return code, err.getvalue()


@fuzz_settings(scale=1.5)
@given(plan=xml_plan, tail=byte_op, call=st.sampled_from(HOOK_CALLS))
def test_hostile_domain_xml_into_the_hook(pristine, tmp_path, plan, tail, call):
    state = tmp_path / "hook" / "state.db"
    state.parent.mkdir(exist_ok=True)
    copy_state(pristine, state)
    xml = mutate_xml(vmlend_domain(), plan, tail)
    before = dump_state(state)
    code, err = hook(state, ["vm1", *call], xml)
    event(f"{call[0]}: exit {code}")
    assert code in (0, 1), (code, err)
    assert_clean_failure(code, err)
    if code == 1:
        assert dump_state(state) == before
    elif call[0] == "prepare":
        # What the hook took, release gives back: nothing stays held.
        assert hook(state, ["vm1", "release", "end", "-"], xml) == (0, "")
        with open_fabric(state) as fabric:
            assert not [d for d in fabric.devices() if d.holder] and fabric.mdevs() == []


# --- 3. domain XML into the CLI ------------------------------------------------------------

XML_COMMANDS = (("show",), ("add-device", "0x11"), ("remove-device", "0x10"))


@fuzz_settings()
@given(plan=xml_plan, tail=byte_op, command=st.sampled_from(XML_COMMANDS))
def test_hostile_domain_xml_into_the_cli(state, tmp_path, plan, tail, command):
    path = tmp_path / "dom.xml"
    xml = mutate_xml(vmlend_domain((0x10,)), plan, tail)
    path.write_bytes(xml)
    before = dump_state(state)
    r = CliRunner().invoke(
        main, ["--state", str(state), "xml", command[0], str(path), *command[1:]]
    )
    event(f"{command[0]}: exit {r.exit_code}")
    assert_cli_result(r)
    if r.exit_code:
        assert path.read_bytes() == xml
    assert dump_state(state) == before  # editing XML never touches the state


# --- 4. topology TOML into fabric init -----------------------------------------------------------

DEFAULT_TOPOLOGY = default_topology_text()[0]


@fuzz_settings(scale=1.5)
@given(plan=toml_plan)
def test_hostile_topology_into_fabric_init(tmp_path_factory, plan):
    d = tmp_path_factory.mktemp("topology")
    path, state = d / "topology.toml", d / "state.db"
    path.write_bytes(mutate_toml(DEFAULT_TOPOLOGY, plan))
    r = CliRunner().invoke(
        main, ["--state", str(state), "fabric", "init", "--topology", str(path), "--node", "gamma"]
    )
    event(f"exit {r.exit_code}")
    assert_cli_result(r)
    if r.exit_code:
        assert dump_state(state) == []  # nothing was put into a state
        return
    for command in (["fabric", "show"], ["devices"], ["status", "-c", "sim:///gamma"]):
        # What fabric init took, every later command can use.
        done = CliRunner().invoke(main, ["--state", str(state), *command])
        assert done.exit_code == 0 and done.exception is None, (command, done.output)


# --- 5. CLI arguments --------------------------------------------------------------------------

#: Commands whose arguments carry fdids, sizes, counts, timeouts and node names; ``{}`` is the
#: hostile value.
ARGUMENT_COMMANDS = (
    ("lend", "{}"),
    ("unlend", "{}"),
    ("path", "{}", "0x10"),
    ("path", "gamma", "{}"),
    ("devices", "--lender", "{}"),
    ("devices", "--kind", "{}"),
    ("xml", "new", "vm1", "--memory", "{}"),
    ("xml", "new", "vm1", "--device", "{}"),
    ("xml", "new", "vm1", "--vcpus", "{}"),
    ("xml", "new", "{}"),
    ("nvme", "reserve", "{}", "vm1", "--size", "1G"),
    ("nvme", "reserve", "0x12", "vm1", "--size", "{}"),
    ("nvme", "reserve", "0x12", "vm1", "--size", "1G", "--queues", "{}"),
    ("nvme", "reserve", "0x12", "vm1", "--size", "1G", "--ram", "{}"),
    ("nvme", "reserve", "0x12", "vm1", "--size", "1G", "--node", "{}"),
    ("nvme", "release", "{}", "vm1"),
    ("hook", "log", "-n", "{}"),
    ("vm", "shutdown", "-c", "sim:///gamma", "--timeout", "{}", "nosuchvm"),
    ("status", "-c", "{}"),
    ("--node", "{}", "devices"),
)


#: A process's argv cannot hold a NUL byte (execve takes C strings); every other value can.
argv_text = nasty_text.map(lambda s: s.replace("\x00", ""))


@fuzz_settings(scale=2)
@given(command=st.sampled_from(ARGUMENT_COMMANDS), value=argv_text)
def test_hostile_cli_arguments(pristine, state, command, value):
    args = [value if a == "{}" else a for a in command]
    before = dump_state(state)
    r = CliRunner().invoke(main, ["--state", str(state), *args])
    event(f"exit {r.exit_code}")
    assert_cli_result(r)
    if r.exit_code:
        assert dump_state(state) == before
    else:
        copy_state(pristine, state)  # the next example starts from the default cluster


# --- 6. the agent hook socket's frames -------------------------------------------------------


def decode(data: bytes, answer: bool = False) -> object:
    reader = wire.Reader(io.BytesIO(data).read)
    return wire.decode_answer(reader) if answer else wire.decode_request(reader)


def assert_frame_or_wire_error(data: bytes, answer: bool) -> None:
    try:
        decoded = decode(data, answer)
    except wire.WireError as e:
        assert "\n" not in str(e)
        return
    if not answer:
        argv, env, xml = decoded  # type: ignore[misc]
        assert len(argv) <= wire.MAX_STRINGS and len(env) <= wire.MAX_STRINGS
        assert len(xml) <= wire.MAX_BLOB
        assert data.startswith(wire.MAGIC) and all(isinstance(a, str) for a in argv)


request = st.tuples(
    st.lists(st.text(max_size=20), max_size=5),
    st.dictionaries(st.text(max_size=10), st.text(max_size=20), max_size=3),
    st.binary(max_size=64),
)


@fuzz_settings(scale=5)
@given(
    frame=st.one_of(
        st.binary(max_size=200),
        request.map(lambda r: wire.encode_request(*r)),
        st.builds(
            lambda r, at, junk: (lambda b: b[: at % (len(b) + 1)] + junk + b[at % (len(b) + 1) :])(
                wire.encode_request(*r)
            ),
            request,
            st.integers(0, 500),
            st.binary(min_size=1, max_size=8),
        ),
    ),
    answer=st.booleans(),
)
def test_hook_socket_frames_decode_or_are_one_wire_error(frame, answer):
    if answer:
        frame = frame.replace(wire.MAGIC, b"R", 1)
    assert_frame_or_wire_error(frame, answer)


@fuzz_settings(scale=2)
@given(r=request)
def test_every_request_the_hook_sends_decodes_to_itself(r):
    argv, env, xml = r
    assert decode(wire.encode_request(argv, env, xml)) == (argv, env, xml)


# --- 7. the configuration file ------------------------------------------------------------------

#: What the hook takes from the file, and the CLI's name for the same setting.
_HOOK_TO_CLI = {
    "VMLEND_STATE": ("state_path",),
    "VMLEND_REGISTRY": ("registry",),
    "VMLEND_NODE": ("node",),
    "VMLEND_BACKEND": ("backend",),
    "VMLEND_HOOK_SOCKET": ("agent", "hook_socket"),
}


def _place_config(path: Path, kind: str, data: bytes) -> None:
    if kind == "file":
        path.write_bytes(data)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "loop":
        path.symlink_to(path.name)
    elif kind == "huge":
        path.write_bytes(b"# " + b"x" * MAX_CONFIG_BYTES + b"\n" + data)


@fuzz_settings(scale=1.5)
@given(plan=config_plan, kind=st.sampled_from(CONFIG_KINDS))
def test_hostile_configuration_file_into_the_cli_and_the_hook(tmp_path_factory, plan, kind):
    """The file the CLI, the agent and the hook all read, mutated (values of other types,
    relative and climbing paths, deep nesting, comments ending in U+2028 or U+0085) and
    replaced by a FIFO, a directory, a link loop or a file over the size bound: taken by both
    alike, or refused by the hook in one ``ConfigError`` and by the CLI in one line; what is
    taken names no path outside the host root."""
    d = tmp_path_factory.mktemp("config")
    root, path = d / "root", d / "vmlend.toml"
    root.mkdir()
    _place_config(path, kind, mutate_config(plan))
    env = {"VMLEND_CONFIG": str(path), "VMLEND_ROOT": str(root)}
    try:
        hook_environment(env)
        hook_error = None
    except VmlendError as e:  # ConfigError: the hook's one line (tests/unit/core/test_config.py)
        hook_error = e
    try:
        defaults = load_default_map(main, ["--config", str(path), "--root", str(root), "agent"])
        cli_error = None
    except VmlendError as e:
        defaults, cli_error = None, e
    took = {False: "took", True: "refused"}
    event(f"{kind}: hook {took[hook_error is not None]}, cli {took[cli_error is not None]}")
    r = CliRunner().invoke(
        main,
        ["--config", str(path), "--root", str(root), "hook", "log"],
        env=dict.fromkeys(_HOOK_TO_CLI),  # the file alone says them
    )
    assert_cli_result(r)
    assert (r.exit_code == 1) == (cli_error is not None), r.output
    if hook_error is not None:
        assert cli_error is not None  # the CLI checks all the hook checks, and more
        assert "\n" not in str(hook_error)
        return
    if cli_error is not None:
        return  # a key or table only the CLI reads
    assert defaults is not None or path.read_bytes() == b""
    agent = (defaults or {}).get("agent", {})
    for name, steps in _HOOK_TO_CLI.items():
        where: object = defaults
        for step in steps:
            where = where.get(step) if isinstance(where, dict) else None
        if name == "VMLEND_HOOK_SOCKET" and _own_agent_socket(path):
            continue  # [agent] hook-socket wins over the top-level one for the agent
        assert env.get(name) == where, (name, env.get(name), where, agent)
        value = env.get(name, "")
        for p in (value, value.removeprefix("sqlite://")):
            if p.startswith("/"):
                assert Path(p) == root or root in Path(p).parents, (name, value)


def _own_agent_socket(path: Path) -> bool:
    import tomllib

    agent = tomllib.loads(path.read_text()).get("agent", {})
    return any(k in agent for k in ("hook-socket", "hook_socket"))


# --- 8. plug requests: what any writer of the registry puts under plugs/<node>/ --------------

_PLUG_UUID = "33333333-3333-3333-3333-333333333333"
_GOOD_PLUG = {
    "id": _PLUG_UUID,
    "vm": "vm1",
    "vm_uuid": _PLUG_UUID,
    "node": "beta",
    "source": "gamma",
    "devices": [{"fdid": 16, "address": {"domain": 0, "bus": 0, "slot": 10, "function": 0}}],
    "mdevs": {"16": "284d71f4-085a-5589-b07e-befe6b537e60"},
    "tokens": {"16": 7},
}
_RECORD = {
    "version": 1,
    "vm": "vm1",
    "vm_uuid": _PLUG_UUID,
    "source": "gamma",
    "destination": "beta",
    "devices": {"16": 7},
}
_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
)
_json = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _mutated_plug(field: str, value: object, drop: bool) -> bytes:
    import json

    req = json.loads(json.dumps(_GOOD_PLUG))
    if drop:
        req.pop(field, None)
    else:
        req[field] = value
    return json.dumps(req).encode()


plug_value = st.one_of(
    st.binary(max_size=200),
    _json.map(lambda v: __import__("json").dumps(v).encode()),
    st.builds(_mutated_plug, st.sampled_from(sorted(_GOOD_PLUG)), _json, st.booleans()),
    st.builds(  # a guest address out of its ranges, an interrupt path nobody knows
        lambda bus, path: _mutated_plug(
            "devices",
            [
                {
                    "fdid": 16,
                    "address": {"domain": 0, "bus": bus, "slot": 0, "function": 0},
                    "interrupts": path,
                }
            ],
            False,
        ),
        st.integers(-5, 5000),
        st.sampled_from(["ntb", "relay", "x", ""]),
    ),
    st.integers(0, 200).map(  # many devices
        lambda n: _mutated_plug("devices", [{"fdid": i} for i in range(n)], False)
    ),
    st.just(b"{" + b'"pad": "' + b"x" * (64 * 1024) + b'"}'),
)
plug_key = st.one_of(
    st.just(_PLUG_UUID.encode()), st.binary(min_size=1, max_size=12).filter(lambda k: b"/" not in k)
)


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # a 64 KiB value
@fuzz_settings()
@given(
    values=st.lists(st.tuples(plug_key, plug_value), min_size=1, max_size=4),
    with_record=st.booleans(),
)
def test_plug_requests_are_served_refused_or_removed_in_one_line(values, with_record, caplog):
    """Whatever any host writes under ``plugs/beta/``: one pass of beta's agent plugs only a
    request that matches the registry's record of a live migration, answers every other
    request with a one-line refusal, removes what is no request, says each in at most one
    line, and never raises; a second pass does nothing; a valid request after them is
    served."""
    import json
    import logging

    from tests.support.memory_registry import MemoryRegistry
    from vmlend.ops.plug_request import PlugOutcome, PlugRequests, serve_plug_requests

    registry = MemoryRegistry()
    requests = PlugRequests(registry)  # type: ignore[arg-type]
    if with_record:
        registry.put_raw(f"migrations/{_PLUG_UUID}".encode(), json.dumps(_RECORD).encode())
    for key, value in values:
        registry.put_raw(b"plugs/beta/" + key, value)
    plugged: list[str] = []

    def plug(req):  # type: ignore[no-untyped-def]
        plugged.append(req.id)
        return [PlugOutcome(d.fdid, True) for d in req.devices]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vmlend"):
        serve_plug_requests(requests, "beta", plug)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        serve_plug_requests(requests, "beta", plug)  # everything was answered or removed
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert all("\n" not in line for line in first)
    written = dict(values)
    assert len([m for m in first if m.startswith(("removed ", "refused "))]) <= len(written)
    for req_id in plugged:  # only the one request the record allows
        assert with_record and req_id == _PLUG_UUID
        sent = json.loads(written[_PLUG_UUID.encode()])
        assert (sent["vm_uuid"], sent["source"], sent["node"]) == (_PLUG_UUID, "gamma", "beta")
        assert {int(k): v for k, v in sent["tokens"].items()} == {16: 7}
    for _key, value, _rev in requests.store.on("beta"):  # what stays is answered
        got = json.loads(value)
        assert got.get("outcome") is not None or got.get("refused") is not None
        if got.get("refused") is not None:
            assert got["outcome"] == [] and "\n" not in got["refused"]
    registry.put_raw(f"migrations/{_PLUG_UUID}".encode(), json.dumps(_RECORD).encode())
    registry.put_raw(b"plugs/beta/" + _PLUG_UUID.encode(), json.dumps(_GOOD_PLUG).encode())
    plugged.clear()
    serve_plug_requests(requests, "beta", plug)
    assert plugged == [_PLUG_UUID]


# --- 9. the metrics endpoint: what any client that reaches the port sends --------------------

_GOOD_GET = b"GET /metrics HTTP/1.0\r\nHost: x\r\nAuthorization: Basic %s\r\n\r\n"
_CREDENTIALS = base64.b64encode(b"prometheus:s3cret")


@pytest.fixture(scope="module")
def metrics_server() -> Iterator[tuple[object, int]]:
    import bcrypt

    from vmlend.agent.metrics import AgentMetrics, MetricsAccess
    from vmlend.agent.metrics_http import MetricsServer

    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
    server = MetricsServer(
        AgentMetrics(), ("127.0.0.1", 0), MetricsAccess(users={"prometheus": hashed}), deadline=2.0
    )
    server.start()
    yield server, server.port
    server.stop()


http_request = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda method, path, version, headers: (
            method
            + b" "
            + path
            + b" "
            + version
            + b"\r\n"
            + b"".join(k + b": " + v + b"\r\n" for k, v in headers)
            + b"\r\n"
        ),
        st.sampled_from([b"GET", b"POST", b"HEAD", b"get", b"", b"GET GET"]),
        st.sampled_from([b"/metrics", b"/health", b"/", b"/x", b"metrics", b"/%00", b"/" * 300]),
        st.sampled_from([b"HTTP/1.0", b"HTTP/1.1", b"HTTP/9", b"", b"HTTP/1.0 x"]),
        st.lists(
            st.tuples(
                st.sampled_from([b"Authorization", b"Host", b"Content-Length", b"X" * 70]),
                st.one_of(
                    st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b),
                    st.sampled_from(
                        [
                            b"Basic " + _CREDENTIALS,
                            b"Basic !!!",
                            b"Basic ",
                            b"Bearer x",
                            b"Basic " + base64.b64encode(b"prometheus:wrong"),
                            b"Basic " + base64.b64encode(b"\xff:\xff"),
                            b"-1",
                            b"99999999",
                        ]
                    ),
                ),
            ),
            max_size=4,
        ),
    ),
    st.builds(  # a good request cut short or with bytes put in
        lambda at, junk: (lambda b: b[: at % (len(b) + 1)] + junk)(_GOOD_GET % _CREDENTIALS),
        st.integers(0, 200),
        st.binary(max_size=8),
    ),
)


@fuzz_settings()
@given(data=http_request)
def test_the_metrics_endpoint_answers_or_closes_in_one_line(metrics_server, data, capfd, caplog):
    """Whatever a client sends (then ends its side): an HTTP answer, or the connection closed,
    within the request's deadline; at most one log line for it, no traceback; only the right
    credentials get the text; a good scrape after it is served."""
    import logging
    import socket
    import time

    _server, port = metrics_server
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vmlend"):
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
            me = f"127.0.0.1:{peer.getsockname()[1]}:"
            peer.sendall(data)
            peer.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := peer.recv(65536):
                answer += chunk
        assert time.monotonic() - started < 5.0
        time.sleep(0.02)  # its line, if any, is written
    lines = [r.getMessage() for r in caplog.records if me in r.getMessage()]
    assert len(lines) <= 1 and all("\n" not in m and "s3cret" not in m for m in lines), lines
    assert "Traceback" not in capfd.readouterr().err
    if answer:
        assert answer.startswith(b"HTTP/1.")
        if answer.split(b" ", 2)[1] == b"200":
            assert b"Basic " + _CREDENTIALS in data  # nobody else gets in
    with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
        peer.sendall(_GOOD_GET % _CREDENTIALS)
        assert peer.recv(12) == b"HTTP/1.0 200"
