"""The role table (who may write which key prefix) and the etcdctl script ``vmlend registry
roles`` prints from it."""

from __future__ import annotations

import inspect
import shlex
from pathlib import Path

from click.testing import CliRunner

from tests.support.cluster_hosts import GPU
from vmlend.cli import main
from vmlend.registry.etcd_keys import Keys
from vmlend.registry.roles import Writers, prefix_of

NODES = ("alpha", "beta", "gamma")


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
