"""TLS to etcd: ``etcds://`` and ``?cacert=&cert=&key=`` in the registry URL, down to a real
etcd that requires client certificates (made here with openssl)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.etcd_daemon import _need_etcd, free_port
from vmlend.errors import ConfigError, StateError
from vmlend.registry import parse_location
from vmlend.registry.etcd_gateway import Endpoint, EtcdGateway, EtcdTls
from vmlend.registry.location import RegistryLocation, open_registry

CA, CERT, KEY = Path("/etc/vmlend/ca.pem"), Path("/etc/vmlend/host.pem"), Path("/etc/vmlend/k.pem")


@pytest.mark.parametrize(
    ("text", "tls"),
    [
        ("etcd://a:1/lab", None),
        ("etcds://a:1/lab", EtcdTls()),  # HTTPS, the system's CAs, no client certificate
        (f"etcds://a:1/lab?cacert={CA}", EtcdTls(cacert=CA)),
        (f"etcd://a:1/lab?cacert={CA}", EtcdTls(cacert=CA)),  # a CA alone means HTTPS too
        (f"etcds://a:1/lab?cacert={CA}&cert={CERT}&key={KEY}", EtcdTls(CA, CERT, KEY)),
        (f"etcds://a:1/lab?key={KEY}&cert={CERT}", EtcdTls(None, CERT, KEY)),
    ],
)
def test_tls_settings_parse_from_the_registry_url(text, tls):
    loc = parse_location(text)
    assert loc == RegistryLocation(endpoints=(Endpoint("a", 1),), cluster="lab", tls=tls)
    assert parse_location(str(loc)) == loc  # what 'hook install' pins reads back the same


@pytest.mark.parametrize(
    ("text", "what"),
    [
        (f"etcds://a/lab?cert={CERT}", "gives a client cert without its pair"),
        (f"etcds://a/lab?key={KEY}", "gives a client key without its pair"),
        ("etcds://a/lab?cacert=ca.pem", "cacert=ca.pem in registry URL .* must be absolute"),
        (f"etcds://a/lab?ca={CA}", "unknown setting 'ca'"),
        ("etcds://a/lab?cacert=", "needs exactly one cacert=PATH"),
        (f"etcds://a/lab?cacert={CA}&cacert={CA}", "needs exactly one cacert=PATH"),
        ("etcds://a/lab?&&", "bad query"),
        (f"etcds://a?cacert={CA}", "needs one cluster name"),
    ],
)
def test_bad_tls_settings_are_refused_in_one_line(text, what):
    with pytest.raises(ConfigError, match=what) as e:
        parse_location(text)
    assert "\n" not in str(e.value)


def test_an_unreadable_tls_file_is_one_line_before_any_request(tmp_path):
    missing = tmp_path / "nope.pem"
    with pytest.raises(ConfigError, match=rf"cannot read the etcd TLS file cacert={missing}"):
        open_registry(f"etcds://127.0.0.1:1/lab?cacert={missing}")


# --- a real etcd over TLS ---------------------------------------------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_certs(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=vmlend-test-ca", cwd=d)  # fmt: skip
    (d / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                 "-extfile", "ext.cnf", cwd=d)  # fmt: skip


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An etcd on loopback that speaks only HTTPS and wants a client certificate: its
    ``host:port`` and the directory of the certificates. Stopped by PID."""
    _need_etcd()
    certs = tmp_path / "certs"
    certs.mkdir()
    _make_certs(certs)
    port, peer = free_port(), free_port()
    client_url, peer_url = f"https://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    log = (tmp_path / "etcd.log").open("ab")
    proc = subprocess.Popen(
        [
            "etcd",
            "--name=default",
            f"--data-dir={tmp_path / 'data'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=default={peer_url}",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            f"--cert-file={certs / 'server.pem'}",
            f"--key-file={certs / 'server.key'}",
            f"--trusted-ca-file={certs / 'ca.pem'}",
            "--client-cert-auth",
        ],
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    try:
        yield f"127.0.0.1:{port}", certs
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.daemon
def test_a_registry_over_tls_with_a_client_certificate(tls_etcd):
    from tests.support.simfabric import make_fabric

    where, certs = tls_etcd
    good = (
        f"etcds://{where}/tls?cacert={certs / 'ca.pem'}"
        f"&cert={certs / 'client.pem'}&key={certs / 'client.key'}"
    )
    loc = parse_location(good)
    gw = EtcdGateway(loc.endpoints, tls=loc.tls)
    deadline = time.monotonic() + 15
    while True:  # etcd is up once a request over TLS works
        try:
            gw.range("health-check")
            break
        except StateError:
            assert time.monotonic() < deadline, "etcd over TLS never answered"
            time.sleep(0.1)
    gw.close()
    make_fabric(good).close()
    with open_registry(good) as reg:
        assert reg.where.endswith("/tls")
    # Without a client certificate, or over plain HTTP, etcd does not let us in.
    for bad in (f"etcds://{where}/tls?cacert={certs / 'ca.pem'}", f"etcd://{where}/tls"):
        with pytest.raises(StateError) as e:
            open_registry(bad)
        assert "\n" not in str(e.value)
