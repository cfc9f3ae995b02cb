"""Tenant control planes that serve: a real kube-apiserver (+ controller manager, scheduler, and kine
where the datastore needs it) per tenant, run by the manager on the tenant's own datastore scope,
on each of the three datastores.

kubectl works as the tenant; one tenant's credentials are refused by another's API server; one
tenant's datastore user cannot read another's data (asked with the datastore's own client); a
killed API server is started again with every object kept; a deleted tenant leaves nothing behind.
"""

from __future__ import annotations

import os
import signal

import msgspec
import psycopg
import pytest
from nats.js.errors import BucketNotFoundError

from controlplane.planes import DATASTORES, Planes, cross_kubeconfig, etcdctl
from tessera.controlplane.datastores import etcd as etcd_store
from tessera.controlplane.datastores import natskv
from tessera.controlplane.localplanes import PlaneRecord

CONFIGMAP = """
apiVersion: v1
kind: ConfigMap
metadata: {name: survivor, namespace: default}
data: {kept: "yes"}
"""


async def _datastore_refuses_other(planes: Planes, mine: str, other: str) -> None:
    """Tenant ``mine``'s datastore user reads its own data and is refused ``other``'s."""
    creds = await planes.credentials(mine)
    theirs = await planes.credentials(other)
    if planes.driver == "etcd":  # etcdctl with the certificate tenant mine's API server logs in with
        own = await etcdctl(creds, planes.directory / "etcdctl", "get", "--prefix", "--count-only",
                            "--write-out=fields", etcd_store.prefix(mine))
        assert own.returncode == 0 and '"Count" : 0' not in own.stdout, own.stdout + own.stderr
        foreign = await etcdctl(creds, planes.directory / "etcdctl", "get", "--prefix", "--keys-only",
                                etcd_store.prefix(other))
        assert foreign.returncode != 0 and "permission denied" in foreign.stderr, foreign.stdout + foreign.stderr
    elif planes.driver == "postgres":
        own = await psycopg.AsyncConnection.connect(creds.endpoint, connect_timeout=5)
        async with own:
            rows = await (await own.execute("SELECT count(*) FROM kine")).fetchone()
            assert rows is not None and rows[0] > 0
        foreign = creds.endpoint.rsplit("/", 1)[0] + "/" + theirs.scope
        with pytest.raises(psycopg.OperationalError, match="permission denied"):
            await psycopg.AsyncConnection.connect(foreign, connect_timeout=5)
    else:
        for owner, other_scope in ((creds, theirs.scope), (theirs, creds.scope)):
            nc = await natskv.connect_tenant(owner)
            try:  # each account holds its own bucket, and sees no other
                js = nc.jetstream(timeout=5)
                assert len(await (await js.key_value(owner.scope)).keys()) > 0
                with pytest.raises(BucketNotFoundError):
                    await js.key_value(other_scope)
            finally:
                await nc.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", DATASTORES, indirect=True)
async def test_tenant_api_servers_serve_on_their_own_datastore(planes: Planes, tmp_path):
    alpha = await planes.create("alpha")
    beta = await planes.create("beta")
    assert alpha.status.endpoint != beta.status.endpoint

    kubeconfig = await planes.kubeconfig("alpha", tmp_path)
    listed = await planes.kubectl(kubeconfig, "get", "ns")
    assert listed.returncode == 0 and "kube-system" in listed.stdout, listed.stderr
    applied = await planes.kubectl(kubeconfig, "apply", "-f", "-", stdin=CONFIGMAP)
    assert applied.returncode == 0, applied.stderr
    got = await planes.kubectl(kubeconfig, "get", "configmap", "survivor", "-o", "jsonpath={.data.kept}")
    assert got.stdout == "yes", got.stderr
    scratch = await planes.kubectl(kubeconfig, "create", "namespace", "scratch")
    assert scratch.returncode == 0, scratch.stderr
    deleted = await planes.kubectl(kubeconfig, "delete", "namespace", "scratch", "--wait=false")
    assert deleted.returncode == 0, deleted.stderr

    # alpha's admin certificate, presented to beta's API server (trusting beta's CA): refused
    beta_pki, alpha_pki = await planes.pki("beta"), await planes.pki("alpha")
    cross = cross_kubeconfig(tmp_path / "cross.kubeconfig", beta.status.endpoint, beta_pki["ca.crt"], alpha_pki)
    refused = await planes.kubectl(cross, "get", "ns")
    assert refused.returncode != 0 and "must be logged in" in refused.stderr, refused.stderr  # 401
    # and beta's own kubeconfig does not see alpha's objects
    beta_kubeconfig = await planes.kubeconfig("beta", tmp_path)
    absent = await planes.kubectl(beta_kubeconfig, "get", "configmap", "survivor")
    assert absent.returncode != 0 and "NotFound" in absent.stderr, absent.stderr

    await _datastore_refuses_other(planes, "alpha", "beta")

    # an API server that stops answering is NotReady, with the reason
    pid = planes.host.pids("alpha")["kube-apiserver"]
    os.kill(pid, signal.SIGSTOP)
    try:
        await planes.wait_phase("alpha", "NotReady", "ApiServerNotAnswering", timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    await planes.wait_phase("alpha", "Ready")
    # a crashed API server is started again by the manager, and the tenant's objects are still there
    os.kill(pid, signal.SIGKILL)
    await planes.wait_phase("alpha", "NotReady", "ProcessExited", timeout=60)
    record = await planes.wait_phase("alpha", "Ready")
    assert planes.host.pids("alpha")["kube-apiserver"] != pid, record.status
    kept = await planes.kubectl(kubeconfig, "get", "configmap", "survivor", "-o", "jsonpath={.data.kept}")
    assert kept.stdout == "yes", kept.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("planes", DATASTORES, indirect=True)
async def test_deleting_a_tenant_leaves_nothing_behind(planes: Planes):
    await planes.create("gamma")
    await _deleting_leaves_nothing(planes, "gamma")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("planes", [("etcd", {"etcd_mode": "dedicated"})], indirect=True)
async def test_a_tenant_on_its_own_etcd_logs_in_with_its_certificate(planes: Planes, tmp_path):
    await planes.create("delta")  # Ready: /readyz and a read through to its etcd and back
    kubeconfig = await planes.kubeconfig("delta", tmp_path)
    listed = await planes.kubectl(kubeconfig, "get", "ns")
    assert listed.returncode == 0 and "kube-system" in listed.stdout, listed.stderr
    creds = await planes.credentials("delta")
    assert creds.endpoint.startswith("https://") and creds.client_cert, creds.endpoint
    own = await etcdctl(creds, tmp_path / "own", "get", "--prefix", "--count-only", "--write-out=fields",
                        etcd_store.prefix("delta"))
    assert own.returncode == 0 and '"Count" : 0' not in own.stdout, own.stdout + own.stderr
    # another tenant's certificate (its own etcd, from the same manager) is refused by delta's etcd
    driver = planes.manager.drivers["etcd"]
    other = await driver.ensure("stranger", None)
    try:
        crossed = msgspec.structs.replace(creds, client_cert=other.client_cert, client_key=other.client_key)
        refused = await etcdctl(crossed, tmp_path / "crossed", "get", "--prefix", "--keys-only",
                                etcd_store.prefix("delta"))
        assert refused.returncode != 0 and "registry" not in refused.stdout, refused.stdout + refused.stderr
    finally:
        await driver.remove("stranger")
    await _deleting_leaves_nothing(planes, "delta")


async def _deleting_leaves_nothing(planes: Planes, name: str) -> None:
    """Delete the tenant; each kind of thing it had (processes, ports, files, and its datastore's
    database, role, prefix, users, bucket, account or server) is listed before, and empty after."""
    plane = planes.host._read(name)
    assert isinstance(plane, PlaneRecord) and plane.pids
    ports = planes.ports(name)
    creds = await planes.credentials(name)
    before = await planes.leftovers(name, ports, creds)
    assert all(before.values()), before  # the listing sees each kind while the tenant has it

    removal = await planes.manager.api.remove(name)
    assert not removal.pending

    left = await planes.leftovers(name, ports, creds)
    assert left == {kind: type(found)() for kind, found in before.items()}
