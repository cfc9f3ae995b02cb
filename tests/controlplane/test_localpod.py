"""The rendered control-plane pod read as local processes (no kubelet): the same command lines and
Secret files, with only what a pod's own network namespace gives moved to ports of the tenant's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.controlplane import manifests
from tessera.controlplane.credentials import DatastoreCredentials, TenantSecrets
from tessera.controlplane.localpod import Ports, cpu_millis, memory_bytes, translate
from tessera.controlplane.pki import PkiAuthority
from tessera.controlplane.spec import TenantControlPlane, parse_spec


def rendered(driver: str, client_cert: str = "") -> list[dict]:
    rec = TenantControlPlane(name="alpha", uid="u", spec=parse_spec({"datastore": {"driver": driver}}))
    endpoint = {"nats": "nats://127.0.0.1:4222", "postgres": "postgresql://r:pw@127.0.0.1:5432/db",
                "etcd": "https://127.0.0.1:2379"}[driver]
    tls = {"ca_cert": "CA", "client_cert": client_cert, "client_key": "KEY"} if client_cert else {}
    secrets = TenantSecrets(tenant="alpha", datastore=DatastoreCredentials(
        driver=driver, endpoint=endpoint, username="tenant-alpha", password="pw", scope="tenant-alpha", **tls))
    PkiAuthority().ensure(rec, secrets, "https://127.0.0.1:7443", "tenant-alpha")
    return manifests.render(rec, secrets, "tessera-system")


@pytest.mark.parametrize("driver", ["nats", "postgres"])
def test_kine_runs_first_on_the_tenants_own_port_and_the_api_server_finds_it(driver, tmp_path: Path):
    pod = translate(rendered(driver), tmp_path, Ports(apiserver=7443, shim=7379))
    names = [p.name for p in pod.processes]
    assert names[0] == "datastore-shim" and set(names) == {"datastore-shim", "kube-apiserver",
                                                           "kube-controller-manager", "kube-scheduler"}
    shim, apiserver = pod.processes[0], next(p for p in pod.processes if p.name == "kube-apiserver")
    assert shim.executable == "kine" and "--listen-address=127.0.0.1:7379" in shim.argv and shim.listens == 7379
    endpoint = next(w for w in shim.argv if w.startswith("--endpoint="))
    secret = {"nats": "bucket=tenant-alpha", "postgres": "postgresql://r:pw@127.0.0.1:5432/db"}[driver]
    assert "$(" not in endpoint and secret in endpoint  # expanded from the Secret
    assert "--etcd-servers=http://127.0.0.1:7379" in apiserver.argv
    assert "--secure-port=7443" in apiserver.argv and apiserver.listens == 7443
    assert not any(w.startswith("--secure-port=6443") for w in apiserver.argv)
    for process in pod.processes:  # every mount path now names the tenant's own files
        assert not any(" /pki/" in f" {w.split('=', 1)[-1]}" for w in process.argv), process.argv
    assert f"--tls-cert-file={tmp_path}/volumes/pki/apiserver.crt" in apiserver.argv
    assert pod.files[tmp_path / "volumes" / "pki" / "apiserver.crt"].startswith(b"-----BEGIN CERTIFICATE")
    limits = {p.name: (p.cpu_millis, p.memory_bytes) for p in pod.processes}
    assert limits["kube-apiserver"] == (1000, 1024 * 1024**2)


def test_etcd_over_tls_logs_in_with_the_tenants_client_certificate(tmp_path: Path):
    pod = translate(rendered("etcd", client_cert="CERT"), tmp_path, Ports(apiserver=7443, shim=7379))
    assert [p.name for p in pod.processes if p.executable == "kine"] == []
    apiserver = next(p for p in pod.processes if p.name == "kube-apiserver")
    datastore = tmp_path / "volumes" / "datastore"
    assert f"--etcd-certfile={datastore}/client.crt" in apiserver.argv
    assert "--etcd-servers=https://127.0.0.1:2379" in apiserver.argv
    assert pod.files[datastore / "client.crt"] == b"CERT"


def test_quantities_read_as_kubernetes_reads_them():
    assert cpu_millis("250m") == 250 and cpu_millis("2") == 2000
    assert memory_bytes("256Mi") == 256 * 1024**2 and memory_bytes("1G") == 10**9


def test_the_controllers_reach_their_own_api_server_on_the_tenants_port_whatever_the_kubeconfig_says(tmp_path: Path):
    # Kubernetes mode: the admin kubeconfig names the Service (a name only cluster DNS resolves);
    # in the pod the controller manager and the scheduler reach the API server over the pod's
    # loopback, which a local run moves to the tenant's port.
    rec = TenantControlPlane(name="alpha", uid="u", spec=parse_spec({"datastore": {"driver": "postgres"}}))
    secrets = TenantSecrets(tenant="alpha", datastore=DatastoreCredentials(
        driver="postgres", endpoint="postgresql://r:pw@127.0.0.1:5432/db", username="r", password="pw", scope="db"))
    PkiAuthority().ensure(rec, secrets, manifests.endpoint(rec), "tenant-alpha")
    assert "server: https://alpha-apiserver.tenant-alpha.svc:6443" in secrets.kubeconfig
    pod = translate(manifests.render(rec, secrets, "tessera-system"), tmp_path, Ports(apiserver=7443, shim=7379))
    for name in ("kube-controller-manager", "kube-scheduler"):
        process = next(p for p in pod.processes if p.name == name)
        assert "--master=https://127.0.0.1:7443" in process.argv, process.argv
        assert not any(":6443" in w for w in process.argv), process.argv
