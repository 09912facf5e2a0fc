"""Which registry a host uses, from ``--registry`` / ``VMLEND_REGISTRY`` (or the older
``--state`` / ``VMLEND_STATE``), and opening it.

- ``etcd://HOST[:PORT][,HOST[:PORT]...]/CLUSTER``: a cluster's state in etcd (port 2379 by
  default), under the key prefix ``/vmlend/CLUSTER/``; ``etcds://`` for HTTPS, with
  ``?cacert=PATH&cert=PATH&key=PATH`` (absolute paths; a ``cacert`` alone also means HTTPS);
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

    def __str__(self) -> str:
        if self.path is not None:
            return f"sqlite://{self.path.resolve()}"
        hosts = ",".join(
            f"[{e.host}]:{e.port}" if ":" in e.host else str(e) for e in self.endpoints
        )
        if self.tls is None:
            return f"etcd://{hosts}/{self.cluster}"
        query = "&".join(
            f"{name}={value}"
            for name, value in (
                ("cacert", self.tls.cacert),
                ("cert", self.tls.cert),
                ("key", self.tls.key),
            )
            if value is not None
        )
        return f"etcds://{hosts}/{self.cluster}" + (f"?{query}" if query else "")


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


def _parse_tls(text: str, query: str, https: bool) -> EtcdTls | None:
    """The TLS settings of ``?cacert=&cert=&key=``; None for plain HTTP."""
    from urllib.parse import parse_qs

    from vmlend.registry.etcd_gateway import EtcdTls

    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ConfigError(f"bad query {query!r} in registry URL {text!r}") from None
    unknown = sorted(set(params) - set(_TLS_PARAMS))
    if unknown:
        raise ConfigError(
            f"unknown setting {unknown[0]!r} in registry URL {text!r}; it takes"
            " cacert=, cert= and key= (absolute paths)"
        )
    paths: dict[str, Path] = {}
    for name, values in params.items():
        if len(values) != 1 or not values[0]:
            raise ConfigError(f"registry URL {text!r} needs exactly one {name}=PATH")
        path = Path(values[0])
        if not path.is_absolute():
            # libvirtd runs the hook from /, so a relative path would name another file.
            raise ConfigError(f"{name}={values[0]} in registry URL {text!r} must be absolute")
        paths[name] = path
    if ("cert" in paths) != ("key" in paths):
        raise ConfigError(
            f"registry URL {text!r} gives a client {'cert' if 'cert' in paths else 'key'}"
            " without its pair; give both cert= and key="
        )
    if not https and not paths:
        return None
    return EtcdTls(paths.get("cacert"), paths.get("cert"), paths.get("key"))


def _parse_etcd(text: str) -> RegistryLocation:
    from vmlend.registry.etcd_gateway import Endpoint
    from vmlend.registry.etcd_keys import check_cluster_name

    https = text.startswith("etcds://")
    rest, _q, query = text.removeprefix("etcds://" if https else "etcd://").partition("?")
    tls = _parse_tls(text, query, https)
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
        endpoints=tuple(endpoints), cluster=check_cluster_name(cluster), tls=tls
    )


def _gateway(loc: RegistryLocation, run_dir: Path | None = None) -> EtcdGateway:
    """A gateway to ``loc``'s etcd, after checking its TLS files can be read. It remembers
    the endpoint that last answered in ``run_dir`` (default: the host's ``run/vmlend``)."""
    from vmlend.registry.etcd_gateway import EtcdGateway

    if loc.tls is not None:
        for name in _TLS_PARAMS:
            path = getattr(loc.tls, name)
            if path is not None and not os.access(path, os.R_OK):
                raise ConfigError(
                    f"cannot read the etcd TLS file {name}={path}; fix the path in --registry"
                    " / VMLEND_REGISTRY or the file's permissions"
                )
    remember = (run_dir or HostEnv.from_env().run / "vmlend") / "etcd-endpoint"
    return EtcdGateway(loc.endpoints, tls=loc.tls, endpoint_file=remember)


def open_registry(
    location: str | Path | RegistryLocation, lease_file: Path | None = None
) -> Registry:
    """The existing state at ``location``; ``StateError`` when it is missing or unusable.
    ``lease_file``: where this host's agent publishes its lease (default: under the host
    root of ``$VMLEND_ROOT``); only a cluster registry uses it."""
    loc = location if isinstance(location, RegistryLocation) else parse_location(location)
    if loc.path is not None:
        return SqliteRegistry.open(loc.path)
    from vmlend.registry.etcd_store import EtcdRegistry

    path = lease_file or hostlease.lease_path(HostEnv.from_env())
    gateway = _gateway(loc, path.parent)
    try:
        return EtcdRegistry.open(gateway, loc.cluster, lambda: hostlease.read(path).lease)
    except BaseException:
        gateway.close()
        raise


def create_registry(
    location: str | Path | RegistryLocation, init: Callable[[StateTxn], None]
) -> Registry:
    """A new state at ``location`` filled by ``init``; ``FileExistsError`` when one exists."""
    loc = location if isinstance(location, RegistryLocation) else parse_location(location)
    if loc.path is not None:
        return SqliteRegistry.create(loc.path, init)
    from vmlend.registry.etcd_store import EtcdRegistry

    gateway = _gateway(loc)
    try:
        return EtcdRegistry.create(gateway, loc.cluster, init)
    except BaseException:
        gateway.close()
        raise
