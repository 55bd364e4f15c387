"""etcd with TLS and client-certificate auth; certificates are made here with
``cryptography`` (a CA, a server cert for 127.0.0.1, a client cert)."""

from __future__ import annotations

import datetime
import ipaddress
import threading

import pytest
from conftest import fresh_run_id
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from elasticd.errors import EtcdError
from elasticd.etcd import EmbeddedEtcd, EtcdConfig, ServerTLS, connect
from elasticd.rendezvous import EtcdRendezvous, RendezvousSettings


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, key, issuer, issuer_key, *, ca=False, usage=None, sans=()):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path, cert=None, key=None):
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return str(path)


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("elasticd-test-ca", ca_key, "elasticd-test-ca", ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _cert(
        "etcd", server_key, "elasticd-test-ca", ca_key,
        usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")],
    )  # fmt: skip
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _cert(
        "node", client_key, "elasticd-test-ca", ca_key, usage=[ExtendedKeyUsageOID.CLIENT_AUTH]
    )
    files = {
        "ca": _write(d / "ca.pem", cert=ca),
        "server": _write(d / "server.pem", cert=server),
        "server_key": _write(d / "server-key.pem", key=server_key),
        "client": _write(d / "client.pem", cert=client),
        "client_key": _write(d / "client-key.pem", key=client_key),
    }
    tls = ServerTLS(
        cert=files["server"], key=files["server_key"], ca=files["ca"], client_cert_auth=True
    )
    etcd = EmbeddedEtcd(data_dir=str(d / "data"), tls=tls)
    good = EtcdConfig(ca_cert=files["ca"], cert=files["client"], key=files["client_key"], timeout=5)
    etcd.start(client=good)
    try:
        yield etcd, good.with_(endpoints=(etcd.endpoint,)), files
    finally:
        etcd.stop()


def test_a_client_with_a_certificate_signed_by_the_ca_reads_and_writes(tls_etcd):
    _, config, _ = tls_etcd
    with connect(config) as client:
        client.put("/tls/k", "v")
        assert client.get("/tls/k").value == b"v"


def test_a_client_without_a_certificate_is_refused_with_a_clear_error(tls_etcd):
    _, config, _ = tls_etcd
    no_cert = config.with_(cert=None, key=None, timeout=1.5, request_timeout=0.5)
    with pytest.raises(EtcdError, match="did not answer"):
        connect(no_cert)


def test_a_plaintext_client_against_a_tls_server_fails_within_the_timeout(tls_etcd):
    etcd, _, _ = tls_etcd
    with pytest.raises(EtcdError, match=r"within 1\.5 s"):
        connect(EtcdConfig(endpoints=(etcd.endpoint,), timeout=1.5, request_timeout=0.5))


def test_a_rendezvous_forms_over_tls_with_client_certificates(tls_etcd):
    _, config, _ = tls_etcd
    settings = RendezvousSettings(run_id=fresh_run_id(), min_nodes=2, max_nodes=2)
    nodes = [
        EtcdRendezvous(client=connect(config), settings=settings, node_id=f"n{i}", owns_client=True)
        for i in range(2)
    ]
    worlds = {}
    threads = [
        threading.Thread(target=lambda n=n: worlds.__setitem__(n.node_id, n.next_world()))
        for n in nodes
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert {w.nodes for w in worlds.values()} == {("n0", "n1")}
    finally:
        for n in nodes:
            n.close()
