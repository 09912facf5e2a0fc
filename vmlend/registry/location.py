"""Which registry a host uses, from ``--registry`` / ``VMLEND_REGISTRY`` (or the older
``--state`` / ``VMLEND_STATE``), and opening it.

- ``etcd://HOST[:PORT][,HOST[:PORT]...]/CLUSTER``: a cluster's state in etcd (port 2379 by
  default), under the key prefix ``/vmlend/CLUSTER/``; ``etcds://`` for HTTPS, with
  ``?cacert=PATH&cert=PATH&key=PATH`` (absolute paths; a ``cacert`` alone also means HTTPS);
  ``user=NAME&password-file=PATH``: this host's etcd user, its password the one line of a
  root-only file (``vmlend.registry.credentials``; docs/cluster.md, "Users and roles");
- ``sqlite:///PATH`` or a plain path: one host's state in an SQLite file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from vmlend.errors import ConfigError
from vmlend.hostenv import HostEnv
from vmlend.registry import hostlease
from vmlend.registry.api import Registry, StateTxn
from vmlend.registry.store import SqliteRegistry

if TYPE_CHECKING:  # the etcd modules (json, hashlib, random, ...) load only for etcd URLs
    from vmlend.registry.etcd_gateway import Endpoint, EtcdGateway, EtcdTls
    from vmlend.registry.topocache import TopologyCache

REGISTRY_ENV = "VMLEND_REGISTRY"
ETCD_DEFAULT_PORT = 2379
_HOST_PORT = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9._-]+))(?::(?P<port>\d+))?$"
)
_EXAMPLE = "etcd://10.0.0.1:2379,10.0.0.2:2379/lab or sqlite:///var/lib/vmlend/state.db"


class RegistryLocation(msgspec.Struct, frozen=True):
    """Where the shared state is: an SQLite ``path``, or etcd ``endpoints`` + ``cluster``."""

    path: Path | None = None
    endpoints: tuple[Endpoint, ...] = ()
    cluster: str = ""
    #: HTTPS settings of an etcd registry; None: plain HTTP.
    tls: EtcdTls | None = None
    #: This host's etcd user ("" : none) and the root-only file holding its password.
    user: str = ""
    password_file: Path | None = None

    def __str__(self) -> str:
        from urllib.parse import quote

        if self.path is not None:
            return f"sqlite://{self.path.resolve()}"
        hosts = ",".join(
            f"[{e.host}]:{e.port}" if ":" in e.host else str(e) for e in self.endpoints
        )
        settings: list[tuple[str, str | Path | None]] = []
        if self.tls is not None:
            settings += [
                ("cacert", self.tls.cacert),
                ("cert", self.tls.cert),
                ("key", self.tls.key),
            ]
        settings += [("user", self.user or None), ("password-file", self.password_file)]
        query = "&".join(
            f"{name}={quote(str(value), safe='/@')}"
            for name, value in settings
            if value is not None
        )
        scheme = "etcd" if self.tls is None else "etcds"
        return f"{scheme}://{hosts}/{self.cluster}" + (f"?{query}" if query else "")


def parse_location(text: str | Path) -> RegistryLocation:
    """A registry URL or a plain SQLite path; ``ConfigError`` for anything else."""
    if isinstance(text, Path):
        return RegistryLocation(path=text)
    if text.startswith(("etcd://", "etcds://")):
        return _parse_etcd(text)
    if text.startswith("sqlite://"):
        rest = text.removeprefix("sqlite://")
        if not rest:
            raise ConfigError(f"registry URL {text!r} names no file; e.g. {_EXAMPLE}")
        return RegistryLocation(path=Path(rest))
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
        raise ConfigError(f"unknown registry URL {text!r}; use {_EXAMPLE}")
    if not text:
        raise ConfigError(f"empty registry location; use {_EXAMPLE}")
    return RegistryLocation(path=Path(text))


_TLS_PARAMS = ("cacert", "cert", "key")
_AUTH_PARAMS = ("user", "password-file")


class _Query(msgspec.Struct, frozen=True):
    tls: EtcdTls | None
    user: str = ""
    password_file: Path | None = None


def _parse_query(text: str, query: str, https: bool) -> _Query:
    """The settings of ``?cacert=&cert=&key=&user=&password-file=``: TLS (None: plain HTTP)
    and this host's etcd user."""
    from urllib.parse import parse_qs

    from vmlend.registry.etcd_gateway import EtcdTls

    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"bad query {query!r} in registry URL {text!r}") from None
    if "password" in params:
        # not quoted back: the message would show the password
        raise ConfigError(
            f"registry URL {text.partition('?')[0]!r} gives a password: the URL is pinned into"
            " the hook and shows in logs; put the password on the one line of a root-only file"
            " and name it with password-file=PATH"
        )
    unknown = sorted(set(params) - set(_TLS_PARAMS) - set(_AUTH_PARAMS))
    if unknown:
        raise ConfigError(
            f"unknown setting {unknown[0]!r} in registry URL {text!r}; it takes"
            " cacert=, cert=, key=, password-file= (absolute paths) and user="
        )
    values: dict[str, str] = {}
    for name, given in params.items():
        if len(given) != 1 or not given[0]:
            what = "NAME" if name == "user" else "PATH"
            raise ConfigError(f"registry URL {text!r} needs exactly one {name}={what}")
        values[name] = given[0]
    paths: dict[str, Path] = {}
    for name in (*_TLS_PARAMS, "password-file"):
        if name not in values:
            continue
        path = Path(values[name])
        if not path.is_absolute():
            # libvirtd runs the hook from /, so a relative path would name another file.
            raise ConfigError(f"{name}={values[name]} in registry URL {text!r} must be absolute")
        paths[name] = path
    if ("cert" in paths) != ("key" in paths):
        raise ConfigError(
            f"registry URL {text!r} gives a client {'cert' if 'cert' in paths else 'key'}"
            " without its pair; give both cert= and key="
        )
    if ("user" in values) != ("password-file" in values):
        given_one, other = (
            ("user", "password-file") if "user" in values else ("password-file", "user")
        )
        raise ConfigError(
            f"registry URL {text!r} gives {given_one}= without {other}=; give both (the"
            " password is the one line of the root-only file password-file= names)"
        )
    tls_paths = {k: v for k, v in paths.items() if k in _TLS_PARAMS}
    tls = (
        EtcdTls(tls_paths.get("cacert"), tls_paths.get("cert"), tls_paths.get("key"))
        if https or tls_paths
        else None
    )
    return _Query(tls, values.get("user", ""), paths.get("password-file"))


def _parse_etcd(text: str) -> RegistryLocation:
    from vmlend.registry.etcd_gateway import Endpoint
    from vmlend.registry.etcd_keys import check_cluster_name

    https = text.startswith("etcds://")
    rest, _q, query = text.removeprefix("etcds://" if https else "etcd://").partition("?")
    settings = _parse_query(text, query, https)
    hosts, slash, cluster = rest.partition("/")
    if not slash or not cluster or "/" in cluster:
        raise ConfigError(
            f"registry URL {text!r} needs one cluster name after the hosts; e.g. {_EXAMPLE}"
        )
    endpoints = []
    for part in hosts.split(","):
        m = _HOST_PORT.match(part.strip())
        if not m:
            raise ConfigError(f"bad etcd endpoint {part!r} in {text!r}; e.g. {_EXAMPLE}")
        port = int(m["port"] or ETCD_DEFAULT_PORT)
        if not 0 < port < 65536:
            raise ConfigError(f"bad etcd port {port} in {text!r}")
        endpoints.append(Endpoint(m["v6"] or m["host"], port))
    return RegistryLocation(
        endpoints=tuple(endpoints),
        cluster=check_cluster_name(cluster),
        tls=settings.tls,
        user=settings.user,
        password_file=settings.password_file,
    )


def _gateway(loc: RegistryLocation, run_dir: Path | None = None) -> EtcdGateway:
    """A gateway to ``loc``'s etcd, after checking its TLS files can be read and reading its
    user's password (``credentials.read_password_file``): a bad file is one line before any
    request. It remembers the endpoint that last answered in ``run_dir`` (default: the host's
    ``run/vmlend``)."""
    from vmlend.registry.etcd_gateway import EtcdGateway

    if loc.tls is not None:
        for name in _TLS_PARAMS:
            path = getattr(loc.tls, name)
            if path is not None and not os.access(path, os.R_OK):
                raise ConfigError(
                    f"cannot read the etcd TLS file {name}={path}; fix the path in --registry"
                    " / VMLEND_REGISTRY or the file's permissions"
                )
    auth = None
    if loc.password_file is not None:
        from vmlend.registry.credentials import read_password_file

        auth = read_password_file(loc.password_file, loc.user)
    remember = (run_dir or HostEnv.from_env().run / "vmlend") / "etcd-endpoint"
    return EtcdGateway(loc.endpoints, tls=loc.tls, endpoint_file=remember, auth=auth)


def open_registry(
    location: str | Path | RegistryLocation,
    lease_file: Path | None = None,
    topology_cache: Path | None = None,
    *,
    upgrading: bool = False,
) -> Registry:
    """The existing state at ``location``; ``StateError`` when it is missing or unusable
    (``upgrading``: a cluster of an older layout is opened, for ``vmlend registry upgrade``).
    ``lease_file``: where this host's agent publishes its lease (default: under the host
    root of ``$VMLEND_ROOT``); only a cluster registry uses it, and ``topology_cache``, the
    directory of this host's copy of its topology (``topocache``; None: none kept). An SQLite
    state needs no copy: its pieces are on this host already."""
    loc = location if isinstance(location, RegistryLocation) else parse_location(location)
    if loc.path is not None:
        return SqliteRegistry.open(loc.path)
    from vmlend.registry.etcd_store import EtcdRegistry

    path = lease_file or hostlease.lease_path(HostEnv.from_env())
    gateway = _gateway(loc, path.parent)
    try:
        return EtcdRegistry.open(
            gateway,
            loc.cluster,
            lambda: hostlease.read(path).lease,
            _cache(topology_cache),
            upgrading=upgrading,
        )
    except BaseException:
        gateway.close()
        raise


def _cache(directory: Path | None) -> TopologyCache | None:
    if directory is None:
        return None
    from vmlend.registry.topocache import TopologyCache

    return TopologyCache(directory)


def create_registry(
    location: str | Path | RegistryLocation,
    init: Callable[[StateTxn], None],
    topology_cache: Path | None = None,
) -> Registry:
    """A new state at ``location`` filled by ``init``; ``FileExistsError`` when one exists.
    ``topology_cache``: as for ``open_registry``."""
    loc = location if isinstance(location, RegistryLocation) else parse_location(location)
    if loc.path is not None:
        return SqliteRegistry.create(loc.path, init)
    from vmlend.registry.etcd_store import EtcdRegistry

    gateway = _gateway(loc)
    try:
        return EtcdRegistry.create(gateway, loc.cluster, init, _cache(topology_cache))
    except BaseException:
        gateway.close()
        raise
