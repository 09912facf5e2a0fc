"""etcd users and roles: ``?user=NAME&password-file=PATH`` in the registry URL, the password
file's checks, the gateway's token (and a new one when etcd forgot it), and a real etcd with
``auth enable`` set up by the etcdctl script ``vmlend registry roles`` prints: the CLI and the
agent work with their host's user, and a host's user cannot write another host's keys."""

from __future__ import annotations

import base64
import inspect
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.cluster_hosts import GPU, NIC, WEB, Host, domain_xml
from tests.support.etcd_daemon import EtcdServer, _need_etcd, cluster_name, host_lease
from tests.support.needs import need
from tests.support.simfabric import make_fabric
from vmlend.cli import main
from vmlend.config import registry_paths, under_root
from vmlend.errors import ConfigError, RegistryAuthError, RegistryPermissionError
from vmlend.registry import open_registry, parse_location
from vmlend.registry.credentials import EtcdAuth
from vmlend.registry.etcd_gateway import EtcdGateway
from vmlend.registry.etcd_keys import Keys
from vmlend.registry.location import _gateway
from vmlend.registry.roles import Writers, admin_of, prefix_of, user_of
from vmlend.topology.model import DeviceState
from vmlend.wiring.fabric import open_fabric

PW = Path("/etc/vmlend/etcd-password")
NODES = ("alpha", "beta", "gamma")


# --- the URL ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "https"),
    [
        (f"etcd://a:1/lab?user=gamma@lab&password-file={PW}", False),
        (f"etcds://a:1/lab?cacert=/ca.pem&user=gamma@lab&password-file={PW}", True),
        (f"etcd://a:1/lab?password-file={PW}&user=gamma%40lab", False),
    ],
)
def test_a_user_and_its_password_file_parse_from_the_registry_url(text, https):
    loc = parse_location(text)
    assert (loc.user, loc.password_file, loc.tls is not None) == ("gamma@lab", PW, https)
    assert parse_location(str(loc)) == loc  # what 'hook install' pins reads back the same
    assert "user=gamma@lab" in str(loc)


def test_the_password_file_moves_under_the_host_root_like_the_tls_files():
    url = f"etcd://a/lab?cacert=/etc/vmlend/ca.pem&user=gamma@lab&password-file={PW}"
    moved = parse_location(registry_paths(url, lambda p: under_root(p, "/srv/host")))
    assert moved.password_file == Path("/srv/host/etc/vmlend/etcd-password")
    assert moved.user == "gamma@lab"


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("etcd://a/lab?user=gamma", "gives user= without password-file="),
        (f"etcd://a/lab?password-file={PW}", "gives password-file= without user="),
        ("etcd://a/lab?user=g&password-file=pw", "password-file=pw .* must be absolute"),
        (f"etcd://a/lab?user=&password-file={PW}", "needs exactly one user=NAME"),
        (f"etcd://a/lab?user=a&user=b&password-file={PW}", "needs exactly one user=NAME"),
        ("etcd://a/lab?user=g&password=s3cret", "gives a password: .* password-file=PATH"),
        (f"etcd://a/lab?user=g&passwordfile={PW}", "unknown setting 'passwordfile'"),
    ],
)
def test_bad_user_settings_are_refused_in_one_line(text, what):
    with pytest.raises(ConfigError, match=what) as e:
        parse_location(text)
    assert "\n" not in str(e.value) and "s3cret" not in str(e.value)


def test_the_password_never_shows_in_a_repr():
    auth = EtcdAuth("gamma@lab", "s3cret", "/etc/vmlend/etcd-password")
    assert "s3cret" not in repr(auth) and "gamma@lab" in repr(auth)


# --- the password file, checked before any request ----------------------------------------------
@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A port that accepts connections and never answers: ``connected`` says whether anybody
    came (a request was attempted)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        s.setblocking(False)
        yield s


def _connected(s: socket.socket) -> bool:
    try:
        conn, _ = s.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def _secret(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def _damage(kind: str, d: Path) -> Path:
    path = d / "etcd-password"
    if kind == "missing":
        return path
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "world-readable":
        _secret(path, "pw\n", 0o644)
    elif kind == "group-readable":
        _secret(path, "pw\n", 0o640)
    elif kind == "in a group-writable directory":
        (d / "open").mkdir(mode=0o770)
        (d / "open").chmod(0o770)
        path = _secret(d / "open" / "etcd-password", "pw\n")
    elif kind == "empty":
        _secret(path, "")
    elif kind == "two lines":
        _secret(path, "pw\nmore\n")
    elif kind == "a blank":
        _secret(path, "two words\n")
    return path


DAMAGE = {
    "missing": "does not exist",
    "directory": "is a directory, not a regular file",
    "fifo": "not a regular file",
    "world-readable": r"is readable by others than root \(mode 0644\).*chmod 600",
    "group-readable": r"is readable by others than root \(mode 0640\)",
    "in a group-writable directory": "non-root can change it: .* writable by its group",
    "empty": "is empty",
    "two lines": "holds more than one line",
    "a blank": "holds a blank; etcdctl reads a password",
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_bad_password_file_is_one_line_before_any_request(kind, tmp_path, listener):
    if "readable" in kind or "writable" in kind:
        need(os.geteuid() == 0, "the root-only rules apply when root reads the file")
    path = _damage(kind, tmp_path)
    port = listener.getsockname()[1]
    url = f"etcd://127.0.0.1:{port}/lab?user=gamma@lab&password-file={path}"
    with pytest.raises(ConfigError, match=DAMAGE[kind]) as e:
        open_registry(url)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert not _connected(listener)  # refused before any request reached the endpoint
    r = CliRunner().invoke(main, ["--registry", url, "devices"])
    assert r.exit_code == 1 and len(r.output.splitlines()) == 1, r.output
    assert str(path) in r.output and not _connected(listener)


# --- the role table ---------------------------------------------------------------------------
#: A value for each parameter of ``Keys``' methods, by name: a new method with a parameter
#: not here fails ``test_every_key_vmlend_writes_is_in_the_role_table`` until it is added
#: (and its key classified in ``roles.PREFIXES``).
SAMPLES: dict[str, object] = {
    "node": "alpha",
    "name": "alpha",
    "fdid": 0x10,
    "adapter": "beta:0",
    "n": 0,
    "unit": "lut",
    "index": 0,
    "start": 0,
    "size": 1,
    "end": 2,
    "at": 0,
    "uuid": "3b0b0c4e-0000-4000-8000-000000000001",
    "request_id": "r1",
    "vm_uuid": "3b0b0c4e-0000-4000-8000-000000000002",
    "key": "schema_version",
    "kind": "dma-window",
    "generation": "0123456789abcdef",
    "vm": "web",
}


def _every_key(keys: Keys) -> dict[str, str]:
    """Every key (not range) ``Keys`` makes, by the member that made it."""
    out: dict[str, str] = {}
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            made: object = getattr(keys, name)
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters)[1:]
            missing = [p for p in params if p not in SAMPLES]
            assert not missing, f"Keys.{name}: add a sample for {missing} (and classify its key)"
            made = member(keys, *(SAMPLES[p] for p in params))
        else:
            continue
        for key in made if isinstance(made, tuple) else (made,):
            if isinstance(key, str) and key.startswith(keys.base) and not key.endswith("/"):
                out[key] = name
    return out


def test_every_key_vmlend_writes_is_in_the_role_table():
    keys = Keys("lab")
    found = _every_key(keys)
    assert len(found) >= 20  # the layout as of schema 2 (a guard against finding nothing)
    for key, member in found.items():
        match = prefix_of(keys, key, NODES)
        assert match is not None, f"Keys.{member} makes {key}: give it a writer in roles.PREFIXES"
    # Each node-scoped key is its own node's, and only its own node's role may write it.
    assert prefix_of(keys, keys.host("alpha"), NODES)[1:] == ("alpha",)
    assert prefix_of(keys, keys.host("alpha2"), NODES) is None  # an exact key, not a prefix
    node_keys = [k for k in found if prefix_of(keys, k, NODES)[0].writers is Writers.NODE]
    assert {found[k] for k in node_keys} == {
        "host", "agent", "vm_holds", "mdev", "parent",
    }  # fmt: skip
    # a node's epoch and extents: any host's reserve may take the node over (its slack)
    assert prefix_of(keys, keys.decider("alpha"), NODES)[0].writers is Writers.HOSTS
    assert prefix_of(keys, keys.topology_digest, NODES)[0].writers is Writers.ADMIN
    for key in (keys.topology_head, keys.topology_piece("0123456789abcdef", 0)):
        assert prefix_of(keys, key, NODES)[0].writers is Writers.ADMIN
    assert prefix_of(keys, keys.hold(GPU), NODES)[0].writers is Writers.HOSTS


def test_the_printed_script_names_no_password_and_grants_each_host_its_own_node(tmp_path):
    url = "etcds://10.0.0.1:2379,[fd00::2]:2379/lab?cacert=/etc/vmlend/ca.pem"
    r = CliRunner().invoke(main, ["--registry", url, "registry", "roles", "--topology",
                                  str(_default_topology(tmp_path))])  # fmt: skip
    assert r.exit_code == 0, r.output
    script = r.stdout
    exports = [shlex.split(ln)[1] for ln in script.splitlines() if ln.startswith("export ")]
    assert "ETCDCTL_ENDPOINTS=https://10.0.0.1:2379,https://[fd00::2]:2379" in exports
    assert "ETCDCTL_CACERT=/etc/vmlend/ca.pem" in exports
    grants = [ln.split()[3:] for ln in script.splitlines() if "grant-permission" in ln]
    gamma = [g for g in grants if g[0] == "gamma@lab"]
    assert ["readwrite", "/vmlend/lab/hosts/gamma"] in [g[1:] for g in gamma]  # exact key
    assert not any("beta" in " ".join(g[1:]) for g in gamma)
    assert ["admin@lab", "readwrite", "/vmlend/lab/", "--prefix"] in grants
    assert script.rstrip().endswith("etcdctl auth enable")
    only = CliRunner().invoke(main, ["--registry", url, "registry", "roles", "--only", "gamma",
                                     "--topology", str(_default_topology(tmp_path))])  # fmt: skip
    assert only.exit_code == 0, only.output
    assert "beta@lab" not in only.stdout and "auth enable" not in only.stdout
    assert "admin@lab" not in only.stdout.split("set -eu")[1]


def _default_topology(tmp_path: Path) -> Path:
    from vmlend.wiring.fabric import default_topology_text

    path = tmp_path / "cluster.toml"
    path.write_text(default_topology_text()[0])
    return path


# --- a real etcd with authentication on -------------------------------------------------------
#: etcd forgets a simple token after this many seconds of disuse (300 by default).
TOKEN_TTL = 1


@dataclass
class Secured:
    """A private etcd whose users and roles the script 'vmlend registry roles' prints sets
    up (``enable``); the password files of the cluster ``cluster``'s users in ``passwords``."""

    server: EtcdServer
    cluster: str
    passwords: Path

    def url(self, node: str | None = None, password_file: Path | None = None) -> str:
        """The registry URL of ``node``'s host (None: the administrator's)."""
        user = admin_of(self.cluster) if node is None else user_of(self.cluster, node)
        pw = password_file or self.passwords / user
        return f"{self.server.url(self.cluster)}?user={user}&password-file={pw}"

    def gateway(self, node: str | None = None) -> EtcdGateway:
        return _gateway(parse_location(self.url(node)), self.passwords.parent / "run")

    def enable(self) -> None:
        """Print the script from the registry and run it with etcdctl: users, roles, auth on."""
        r = CliRunner().invoke(main, ["--registry", self.server.url(self.cluster), "registry",
                                      "roles"])  # fmt: skip
        assert r.exit_code == 0, r.output
        run = subprocess.run(
            ["sh", "-c", r.stdout],
            env={**os.environ, "VMLEND_PASSWORDS": str(self.passwords)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr


@pytest.fixture
def unsecured(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Secured]:
    """A private etcd with a cluster (``fabric init`` done while authentication is off, as
    docs/cluster.md deploys) and every user's password file; authentication still off."""
    _need_etcd()
    need(shutil.which("etcdctl") is not None, "etcdctl is missing (make sysdeps: etcd-client)")
    server = EtcdServer(
        tmp_path / "etcd", extra_args=(f"--auth-token-ttl={TOKEN_TTL}", "--bcrypt-cost=4")
    )
    server.start()
    try:
        cluster = cluster_name(request)
        make_fabric(server.url(cluster)).close()
        passwords = tmp_path / "passwords"
        passwords.mkdir(mode=0o700)
        for user in ("root", admin_of(cluster), *(user_of(cluster, n) for n in NODES)):
            _secret(passwords / user, secrets.token_urlsafe(18) + "\n")
        yield Secured(server, cluster, passwords)
    finally:
        server.stop()


@pytest.fixture
def secured(unsecured: Secured) -> Secured:
    """``unsecured`` with its users and roles set up and authentication on."""
    unsecured.enable()
    return unsecured


def _put(gw: EtcdGateway, key: str, value: bytes = b"x", lease: int = 0) -> None:
    body: dict[str, object] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = lease
    gw.call("kv/put", body)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _value(gw: EtcdGateway, key: str) -> bytes | None:
    _rev, kvs = gw.range(key)
    return kvs[0].value if kvs else None


@pytest.mark.daemon
def test_a_host_configured_before_auth_enable_works_before_and_after(unsecured):
    """Hosts may get their user before the operator turns authentication on: until then the
    gateway sends no token (one authentication tried, answered "not enabled"), and once etcd
    asks for one it authenticates and goes on."""
    keys = Keys(unsecured.cluster)
    gamma = unsecured.gateway("gamma")
    for _ in range(3):
        assert _value(gamma, keys.meta("schema_version")) is not None
    assert gamma.authentications == 1
    unsecured.enable()
    _put(gamma, keys.host("gamma"))  # etcd now asks for a user: authenticated, then written
    assert gamma.authentications == 2
    with pytest.raises(RegistryPermissionError):
        _put(gamma, keys.host("beta"))
    gamma.close()


@pytest.mark.daemon
def test_without_a_user_or_with_a_wrong_password_etcd_refuses_in_one_line(secured, tmp_path):
    plain = secured.server.url(secured.cluster)
    with pytest.raises(RegistryAuthError, match=r"requires a user .*\?user=NAME&password-file="):
        open_registry(plain)
    wrong = _secret(tmp_path / "wrong", "not-the-password\n")
    for url in (plain, secured.url("gamma", wrong)):
        r = CliRunner().invoke(main, ["--registry", url, "devices"])
        assert r.exit_code == 1 and len(r.output.splitlines()) == 1, r.output
        assert "Traceback" not in r.output
    assert f"refused user 'gamma@{secured.cluster}': wrong password" in r.output
    assert str(wrong) in r.output  # where the password came from, never the password
    with open_registry(secured.url("gamma")) as reg:  # the right one
        assert reg.where.endswith(secured.cluster)


@pytest.mark.daemon
def test_an_expired_token_is_renewed_and_the_request_sent_once_more(
    secured, tmp_path, monkeypatch
):
    """etcd forgets a token after TOKEN_TTL s of disuse: the next request is refused with
    "invalid auth token", authenticates again and goes through, once."""
    host_lease(secured.server, tmp_path / "gamma")
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "gamma"))
    with open_fabric(secured.url("gamma"), "gamma") as f:
        gw = f.registry.gateway  # type: ignore[attr-defined]
        f.reserve(GPU, WEB)
        first = gw.authentications
        assert first >= 1
        time.sleep(TOKEN_TTL + 1.5)  # etcd checks its tokens' TTL once a second
        assert f.release(GPU, WEB) is True
        assert gw.authentications == first + 1
        assert f.device(GPU).state is DeviceState.AVAILABLE
        # Another gateway of the process (the agent opens one per hook call) takes that token.
        with open_registry(secured.url("gamma")) as again:
            with again.read() as tx:
                assert tx.hold(GPU) is None
            assert again.gateway.authentications == 0  # type: ignore[attr-defined]


@pytest.mark.daemon
def test_a_hosts_user_cannot_write_another_hosts_keys(secured, tmp_path):
    keys = Keys(secured.cluster)
    gamma, admin = secured.gateway("gamma"), secured.gateway()
    theirs = [
        keys.host("beta"),
        keys.agent("beta"),
        keys.vm_holds("beta", "db"),
        keys.mdev("beta", SAMPLES["uuid"]),  # type: ignore[arg-type]
        keys.parent("beta", GPU),
        keys.topology_digest,  # the administrator's
        keys.meta("schema_version"),
        keys.node("alpha"),
    ]
    before = {k: _value(admin, k) for k in theirs}
    for key in theirs:
        with pytest.raises(RegistryPermissionError, match="refused user 'gamma@") as e:
            _put(gamma, key)
        assert "\n" not in str(e.value)
        with pytest.raises(RegistryPermissionError):
            gamma.call("kv/deleterange", {"key": _b64(key)})
    assert {k: _value(admin, k) for k in theirs} == before
    # Its own node's keys and the shared ones it may write: another node's epoch too (a
    # reserve short of units there takes that node over to give its slack back)
    mine = (keys.host("gamma"), keys.vm_holds("gamma", "db"), keys.hold(0x99))
    for key in (*mine, keys.decider("beta"), keys.extents("beta")):
        _put(gamma, key)
        assert _value(admin, key) == b"x"
        gamma.call("kv/deleterange", {"key": _b64(key)})
    # The CLI says it in one line: marking a node down is the administrator's.
    down = ["--node", "gamma", "fabric", "node-down", "alpha"]
    r = CliRunner().invoke(main, ["--registry", secured.url("gamma"), *down])
    assert r.exit_code == 1 and len(r.output.splitlines()) == 1, r.output
    assert "refused user 'gamma@" in r.output and "permission" in r.output
    r = CliRunner().invoke(main, ["--registry", secured.url(), *down])
    assert r.exit_code == 0, r.output  # the administrator may
    gamma.close()
    admin.close()


@pytest.mark.daemon
def test_what_a_compromised_host_can_still_do_is_what_the_docs_say(secured):
    """docs/cluster.md, "What a compromised host can do", as etcd 3.4 measures it: it cannot
    put a record on another host's lease nor revoke that lease (the lease carries the other
    host's ``hosts/<node>``), but it may keep that lease alive (keepalives are not checked)
    and delete a hold another host made (``holds/`` is every host's)."""
    keys = Keys(secured.cluster)
    beta, gamma = secured.gateway("beta"), secured.gateway("gamma")
    lease = int(beta.call("lease/grant", {"TTL": 60, "ID": 0})["ID"])
    _put(beta, keys.host("beta"), b"{}", lease)
    _put(beta, keys.hold(NIC), b"beta's", lease)
    with pytest.raises(RegistryPermissionError):
        _put(gamma, keys.hold(0x98), b"on beta's lease", lease)
    with pytest.raises(RegistryPermissionError):
        gamma.call("kv/lease/revoke", {"ID": lease})
    ttl = int(gamma.call("lease/keepalive", {"ID": lease})["result"]["TTL"])
    assert ttl == 60  # another host's lease, kept alive
    gamma.call("kv/deleterange", {"key": _b64(keys.hold(NIC))})
    assert _value(beta, keys.hold(NIC)) is None  # another host's hold, gone
    beta.close()
    gamma.close()


def _hv(host: Host):
    from vmlend.wiring.hypervisor import open_hypervisor

    hook = [sys.executable, "-m", "vmlend.hook", "--registry", host.url, "--node", host.node]
    return open_hypervisor(f"sim:///{host.node}", state_dir=host.root, hook_command=hook)


def _wait_for(what: str, check, log, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} never happened\n{log()}"
        time.sleep(0.1)


@pytest.mark.daemon
@pytest.mark.slow
def test_the_cli_and_the_agents_work_with_their_hosts_user(secured, tmp_path, monkeypatch):
    """alpha lends 0x10, gamma's VM borrows it, each host with its own user: the hook's reserve
    and release, the agents' leases and keepalives, and alpha's agent taking the device back
    after gamma's died, its token forgotten by etcd between its scans (every 2 s, the token's
    TTL 1 s) and renewed."""
    alpha = Host(secured.url("alpha"), "alpha", tmp_path / "alpha")
    gamma = Host(secured.url("gamma"), "gamma", tmp_path / "gamma")
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))  # the hooks _hv runs are gamma's
    admin = secured.gateway()
    keys = Keys(secured.cluster)
    try:
        alpha.start_agent("--interval", "2")
        gamma.start_agent("--connect", "sim:///gamma")
        lease = gamma.published_lease()
        assert lease is not None
        hv = _hv(gamma)
        hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
        hv.start("web")  # the prepare hook reserves 0x10 as gamma@...
        r = gamma.vmlend("devices", "--json")
        assert r.returncode == 0, r.stderr
        [gpu] = [d for d in json.loads(r.stdout)["devices"] if d["fdid"] == "0x10"]
        assert gpu["holder"] is not None, gpu
        assert (gpu["holder"]["node"], gpu["holder"]["vm"]) == ("gamma", "web")
        time.sleep(TOKEN_TTL + 2)  # longer than the token's TTL and the lease's (2 s)
        assert gamma.published_lease() == lease  # renewed all along
        _rev, kvs = admin.range(keys.host("gamma"))
        assert kvs and kvs[0].lease == lease
        r = gamma.vmlend("vm", "destroy", "web", "--connect", "sim:///gamma")
        assert r.returncode == 0, r.stderr  # the release hook
        assert _value(admin, keys.hold(GPU)) is None and _value(admin, keys.fence(GPU)) is None
        hv.start("web")
        assert _value(admin, keys.hold(GPU)) is not None
        gamma.stop_agent(signal.SIGKILL)  # its lease ends with web's hold; the fence stays
        _wait_for("alpha took 0x10 back", lambda: "took back 0x10" in alpha.log(), alpha.log)
        assert _value(admin, keys.fence(GPU)) is None
        assert "invalid auth token; authenticated again as alpha@" in alpha.log()
        for line in alpha.log().splitlines():
            assert "permission" not in line and "refused" not in line, line
    finally:
        for h in (alpha, gamma):
            h.stop_agent(signal.SIGKILL)
        admin.close()
