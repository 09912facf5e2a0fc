"""etcd users and roles: ``?user=NAME&password-file=PATH`` in the registry URL, the password
file's checks (one line before any request), the role table and the etcdctl script
``vmlend registry roles`` prints."""

from __future__ import annotations

import inspect
import os
import shlex
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.cluster_hosts import GPU
from tests.support.needs import need
from vmlend.cli import main
from vmlend.config import registry_paths, under_root
from vmlend.errors import ConfigError
from vmlend.registry import open_registry, parse_location
from vmlend.registry.credentials import EtcdAuth
from vmlend.registry.etcd_keys import Keys
from vmlend.registry.roles import Writers, prefix_of

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
    "uuid": "3b0b0c4e-0000-4000-8000-000000000001",
    "request_id": "r1",
    "key": "schema_version",
    "kind": "dma-window",
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
        "host", "agent", "held_on", "vm_holds", "mdev", "parent",
    }  # fmt: skip
    assert prefix_of(keys, keys.topology_digest, NODES)[0].writers is Writers.ADMIN
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
