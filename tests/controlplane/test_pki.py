"""Tenant PKI: a chain a real TLS handshake accepts, the right names, rotation before expiry."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ssl

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import x25519

from tessera.controlplane.credentials import TenantSecrets
from tessera.controlplane.pki import LEAVES, PkiAuthority, load_cert
from tessera.controlplane.spec import TenantControlPlane, parse_spec


def record(**network) -> TenantControlPlane:
    return TenantControlPlane(name="alpha", uid="u1", spec=parse_spec({"network": network}))


def test_serving_certificate_carries_every_name_and_chains_to_the_tenant_ca():
    secrets = TenantSecrets(tenant="alpha")
    rec = record(address="203.0.113.7", certSans=["api.alpha.example.com"])
    assert PkiAuthority().ensure(rec, secrets, "https://203.0.113.7:6443", "tenant-alpha")
    ca = load_cert(secrets.pki["ca.crt"])
    server = load_cert(secrets.pki["apiserver.crt"])
    server.verify_directly_issued_by(ca)
    load_cert(secrets.pki["front-proxy-client.crt"]).verify_directly_issued_by(load_cert(secrets.pki["front-proxy-ca.crt"]))
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = sans.get_values_for_type(x509.DNSName)
    ips = {str(i) for i in sans.get_values_for_type(x509.IPAddress)}
    assert {"kubernetes.default.svc", "alpha-apiserver.tenant-alpha.svc", "api.alpha.example.com"} <= set(dns)
    assert {"203.0.113.7", "10.96.0.1"} <= ips
    assert {"sa.key", "sa.pub", "datastore-client.crt", "admin.key"} <= set(secrets.pki)
    kubeconfig = yaml.safe_load(secrets.kubeconfig)
    assert kubeconfig["clusters"][0]["cluster"]["server"] == "https://203.0.113.7:6443"
    # Idempotent: nothing is reissued on a second pass.
    before = dict(secrets.pki)
    assert not PkiAuthority().ensure(rec, secrets, "https://203.0.113.7:6443", "tenant-alpha")
    assert secrets.pki == before


async def test_admin_kubeconfig_passes_a_real_mutual_tls_handshake(tmp_path):
    secrets = TenantSecrets(tenant="alpha")
    PkiAuthority().ensure(record(), secrets, "https://localhost:6443", "tenant-alpha")
    for name, pem in secrets.pki.items():
        (tmp_path / name).write_text(pem)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=tmp_path / "ca.crt")
    server_ctx.load_cert_chain(tmp_path / "apiserver.crt", tmp_path / "apiserver.key")
    server_ctx.verify_mode = ssl.CERT_REQUIRED
    seen = []

    async def handle(reader, writer):
        seen.append(writer.get_extra_info("peercert")["subject"])
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    kc = yaml.safe_load(secrets.kubeconfig)
    user = kc["users"][0]["user"]
    (tmp_path / "kc.crt").write_bytes(base64.b64decode(user["client-certificate-data"]))
    (tmp_path / "kc.key").write_bytes(base64.b64decode(user["client-key-data"]))
    (tmp_path / "kc-ca.crt").write_bytes(base64.b64decode(kc["clusters"][0]["cluster"]["certificate-authority-data"]))
    client_ctx = ssl.create_default_context(cafile=tmp_path / "kc-ca.crt")
    client_ctx.load_cert_chain(tmp_path / "kc.crt", tmp_path / "kc.key")
    try:
        # Hostname checked against the certificate's SANs, as kubectl would.
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx, server_hostname="localhost")
        await reader.read()
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    assert any(("organizationName", "system:masters") in rdn for rdn in seen[0])


def test_leaves_rotate_before_expiry_and_on_name_change_while_the_ca_stays():
    now = dt.datetime.now(dt.timezone.utc)
    clock = [now]
    authority = PkiAuthority(cert_days=90, rotate_before_days=30, clock=lambda: clock[0])
    secrets = TenantSecrets(tenant="alpha")
    authority.ensure(record(), secrets, "https://x:6443", "tenant-alpha")
    first = dict(secrets.pki)
    clock[0] = now + dt.timedelta(days=59)  # 31 days left: not yet
    assert not authority.ensure(record(), secrets, "https://x:6443", "tenant-alpha")
    clock[0] = now + dt.timedelta(days=61)  # 29 days left: rotate
    assert authority.ensure(record(), secrets, "https://x:6443", "tenant-alpha")
    assert secrets.pki["ca.crt"] == first["ca.crt"]
    for leaf in LEAVES:
        assert secrets.pki[f"{leaf}.crt"] != first[f"{leaf}.crt"]
    assert secrets.not_after > (now + dt.timedelta(days=61 + 89)).timestamp()
    rotated = dict(secrets.pki)
    assert authority.ensure(record(certSans=["new.example.com"]), secrets, "https://x:6443", "tenant-alpha")
    assert secrets.pki["apiserver.crt"] != rotated["apiserver.crt"]
    assert secrets.pki["admin.crt"] == rotated["admin.crt"]


def test_leaves_a_replaced_ca_did_not_sign_are_issued_again_from_it():
    authority = PkiAuthority()
    secrets = TenantSecrets(tenant="alpha")
    authority.ensure(record(), secrets, "https://x:6443", "tenant-alpha")
    # the CA replaced underneath its leaves (a restore, a hand rotation): same name, another key
    ca, key = authority.new_ca("alpha-ca")
    secrets.pki.update({"ca.crt": ca, "ca.key": key})
    stale = dict(secrets.pki)
    assert authority.ensure(record(), secrets, "https://x:6443", "tenant-alpha")
    for leaf in ("apiserver", "datastore-client", "admin"):  # what that CA signs
        assert secrets.pki[f"{leaf}.crt"] != stale[f"{leaf}.crt"]
        load_cert(secrets.pki[f"{leaf}.crt"]).verify_directly_issued_by(load_cert(ca))
    assert secrets.pki["front-proxy-client.crt"] == stale["front-proxy-client.crt"]  # (its CA stayed)
    kubeconfig = yaml.safe_load(secrets.kubeconfig)
    assert base64.b64decode(kubeconfig["clusters"][0]["cluster"]["certificate-authority-data"]).decode() == ca


def test_a_ca_key_that_cannot_sign_is_refused_saying_what_to_do():
    secrets = TenantSecrets(tenant="alpha")
    PkiAuthority().ensure(record(), secrets, "https://203.0.113.7:6443", "tenant-alpha")
    pki = dict(secrets.pki)
    pki["ca.key"] = x25519.X25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    del pki["apiserver.crt"]  # so that a leaf is signed again
    secrets.pki = pki
    with pytest.raises(ValueError, match="X25519PrivateKey, which cannot sign certificates: remove"):
        PkiAuthority().ensure(record(), secrets, "https://203.0.113.7:6443", "tenant-alpha")
