"""`kubectl apply -f` of a TenantControlPlane, against the strict API-server emulator and a real NATS:
the manager creates the tenant, writes its status (phase, endpoint, conditions, observedGeneration)
through the status subresource, changes its quota on an update, reports an invalid spec on the
object naming the field while it goes on serving others, and on delete (its finalizer) removes
everything the tenant had before the object goes."""

from __future__ import annotations

import asyncio
import base64
import re
from pathlib import Path

import pytest
import yaml

from tessera.controlplane import crd
from tessera.controlplane.app import Manager
from tessera.controlplane.datastores.natskv import NatsKvDriver
from tessera.controlplane.kube import KubeHost, UsersSecret
from tessera.controlplane.resources import FINALIZER
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared.bus import Bus
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.kubeapi import Invalid, KubeApi
from tessera.shared.settings import BusSettings

import kube_rbac
from kubectl import kubectl

from kit import eventually

TCP = (f"{crd.GROUP}/{crd.VERSION}", crd.PLURAL)
MANAGER_YAML = Path(__file__).resolve().parents[2] / "deploy/k8s/controlplane/manager.yaml"
NAMESPACE = "team-a"


def manifest(name: str, spec: dict) -> str:
    """The YAML a user keeps and hands to `kubectl apply -f`."""
    return yaml.safe_dump({"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": "TenantControlPlane",
                           "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec})


async def kubectl_apply(kube: KubeApi, text: str) -> dict:
    """`kubectl apply --server-side -f`: the file's YAML as an apply patch under kubectl's manager."""
    doc = yaml.safe_load(text)
    path = f"/apis/{doc['apiVersion']}/namespaces/{doc['metadata']['namespace']}/{crd.PLURAL}/{doc['metadata']['name']}"
    return await kube.call("PATCH", path, doc, query=[("fieldManager", "kubectl")],
                           content_type="application/apply-patch+yaml")


def printer_columns(obj: dict) -> dict[str, str]:
    """What `kubectl get tcp` prints for ``obj``: the CRD's additionalPrinterColumns, evaluated."""
    out = {}
    for column in crd.definition()["spec"]["versions"][0]["additionalPrinterColumns"]:
        if column.get("priority"):
            continue  # (only with -o wide)
        value: object = obj
        for part in re.findall(r'\.(\w+)(?:\[\?\(@\.(\w+)=="(\w+)"\)\])?', column["jsonPath"]):
            key, field, wanted = part
            value = (value or {}).get(key) if isinstance(value, dict) else None
            if field:
                value = next((item for item in value or [] if item.get(field) == wanted), None)
        out[column["name"]] = "" if value is None else str(value)
    return out


def condition(obj: dict, kind: str) -> dict:
    return next(c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind)


@pytest.fixture
async def manager(apiserver, nats_url):
    """The manager as manager.yaml runs it: Kubernetes host, NATS datastore users kept in a Secret."""
    bus = await Bus.connect(BusSettings(url=nats_url, file_storage=False), "controlplane")
    await bus.ensure_topology()
    for namespace in (NAMESPACE, "tessera-system"):
        await apiserver.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    users = UsersSecret("tessera-system/tessera-nats-users", kube=KubeApi.for_url(apiserver.url))
    mgr = await Manager.start(bus, ControlPlaneSettings(host_mode="kubernetes"), host=KubeHost.for_url(apiserver.url),
                              drivers={"nats": NatsKvDriver(bus, nats_url, users)})
    tasks = [asyncio.create_task(mgr.resources.run(), name="tenantcontrolplanes"),
             asyncio.create_task(mgr.follow_host(), name="readiness-watch")]
    try:
        yield mgr, tasks
    finally:
        # Not one cancel each: a task cancelled while a NATS reply arrives may live through it
        # (Python 3.11's wait_for) and watch on forever (`tessera.shared.cancelling`).
        await cancel_and_wait(tasks)
        await mgr.close()
        await bus.close()


async def test_apply_creates_the_tenant_status_follows_update_changes_quota_delete_cleans_up(apiserver, kube,
                                                                                            manager):
    mgr, tasks = manager
    obj = lambda: apiserver.object(*TCP, "alpha", NAMESPACE)  # noqa: E731
    await kubectl_apply(kube, manifest("alpha", {"quota": {"gpus": 4}, "network": {"nodeCidrs": ["192.168.7.0/24"]}}))

    provisioning = await eventually(lambda: obj().get("status", {}).get("phase") == "Provisioning" and obj(), what="status")
    assert FINALIZER in provisioning["metadata"]["finalizers"]
    assert provisioning["status"]["endpoint"] == "https://alpha-apiserver.tenant-alpha.svc:6443"
    assert provisioning["status"]["observedGeneration"] == provisioning["metadata"]["generation"] == 1
    ready = condition(provisioning, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "WaitingForControlPlane" and "0/2" in ready["message"]
    assert condition(provisioning, "Valid")["status"] == "True"
    assert (await mgr.store.tenants.get("alpha")).value.quota.gpus == 4  # the quota placement reads
    assert '"user": "tenant-alpha"' in users_listed(apiserver)  # its datastore user, for nats-server
    deployment = apiserver.object("apps/v1", "deployments", "alpha-control-plane", "tenant-alpha")
    assert deployment is not None and apiserver.object("v1", "secrets", "alpha-datastore", "tenant-alpha")

    # the Deployment controller reports the replicas ready: the object says so
    await apiserver.patch("apps/v1", "deployments", "alpha-control-plane",
                          {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                      "observedGeneration": deployment["metadata"]["generation"]}},
                          "tenant-alpha", subresource="status")
    shown = await eventually(lambda: condition(obj(), "Ready")["status"] == "True" and obj(), what="ready")
    discovery = await kube.call("GET", f"/apis/{TCP[0]}")  # what `kubectl get tcp` resolves the short name by
    assert "tcp" in next(r for r in discovery["resources"] if r["name"] == crd.PLURAL)["shortNames"]
    assert printer_columns(shown) == {"Phase": "Ready", "Ready": "True",
                                      "Endpoint": "https://alpha-apiserver.tenant-alpha.svc:6443",
                                      "Age": shown["metadata"]["creationTimestamp"]}

    await kubectl_apply(kube, manifest("alpha", {"quota": {"gpus": 8}, "network": {"nodeCidrs": ["192.168.7.0/24"]}}))
    await eventually(lambda: obj()["status"]["observedGeneration"] == 2, what="generation 2 observed")
    assert (await mgr.store.tenants.get("alpha")).value.quota.gpus == 8

    await kube.delete(f"/apis/{TCP[0]}/namespaces/{NAMESPACE}/{crd.PLURAL}/alpha")
    await eventually(lambda: obj() is None, what="the object gone once the finalizer is removed")
    assert await mgr.store.controlplanes.get("alpha") is None
    assert await mgr.store.secrets.get("alpha") is None  # credentials
    assert await mgr.store.tenants.get("alpha") is None  # quota
    assert apiserver.object("apps/v1", "deployments", "alpha-control-plane", "tenant-alpha") is None
    assert apiserver.object("v1", "secrets", "alpha-datastore", "tenant-alpha") is None
    namespace = apiserver.object("v1", "namespaces", "tenant-alpha")
    assert namespace is None or namespace["metadata"].get("deletionTimestamp")
    assert not any(t.done() for t in tasks)
    assert "tenant-alpha" not in users_listed(apiserver)  # its datastore user revoked

    # the manager's ClusterRole grants exactly what it called (the user's kubectl calls aside)
    role = next(d for d in yaml.safe_load_all(MANAGER_YAML.read_text()) if d and d["kind"] == "ClusterRole")
    kube_rbac.check([r for r in apiserver.requests if r[2].get("fieldManager") != "kubectl"
                     and not (r[0] == "DELETE" and crd.PLURAL in r[1])], role)


def users_listed(apiserver) -> str:
    secret = apiserver.object("v1", "secrets", "tessera-nats-users", "tessera-system")
    return base64.b64decode(secret["data"]["users.conf"]).decode() if secret else ""


async def test_an_invalid_spec_is_a_condition_naming_the_field_and_the_manager_goes_on(apiserver, kube, manager):
    mgr, tasks = manager
    get = lambda name: apiserver.object(*TCP, name, NAMESPACE)  # noqa: E731
    # what the CRD's schema cannot say: the pod range overlaps the service range
    await kubectl_apply(kube, manifest("beta", {"network": {"serviceCidr": "10.96.0.0/16", "podCidr": "10.96.0.0/12"}}))
    refused = await eventually(lambda: (get("beta") or {}).get("status") and get("beta"), what="beta's status")
    valid = condition(refused, "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert valid["message"].startswith("$.spec.network.podCidr: ")
    assert refused["status"]["phase"] == "NotReady" and await mgr.store.controlplanes.get("beta") is None
    # what the schema can say is refused by the API server itself, naming the field
    with pytest.raises(Invalid, match=r"spec.quota.gpus"):
        await kubectl_apply(kube, manifest("gamma", {"quota": {"gpus": -1}}))

    # the manager serves the others meanwhile, and a fixed spec is taken
    await kubectl_apply(kube, manifest("alpha", {"quota": {"gpus": 2}}))
    await eventually(lambda: (get("alpha") or {}).get("status", {}).get("phase") == "Provisioning", what="alpha served")
    await kubectl_apply(kube, manifest("beta", {"network": {"podCidr": "10.244.0.0/16"}}))
    fixed = await eventually(lambda: condition(get("beta"), "Valid")["status"] == "True" and get("beta"), what="beta fixed")
    assert fixed["status"]["phase"] == "Provisioning" and await mgr.store.controlplanes.get("beta") is not None

    # a change that breaks a working tenant's spec is refused and leaves the tenant as it was
    bad = {"quota": {"gpus": 3}, "resources": {"scheduler": {"requests": {"cpuMillis": 200, "memoryMib": 128},
                                                             "limits": {"cpuMillis": 100, "memoryMib": 128}}}}
    await kubectl_apply(kube, manifest("alpha", bad))
    await eventually(lambda: condition(get("alpha"), "Valid")["status"] == "False", what="alpha refused")
    assert "$.spec.resources.scheduler.limits.cpuMillis" in condition(get("alpha"), "Valid")["message"]
    assert (await mgr.store.tenants.get("alpha")).value.quota.gpus == 2
    assert get("alpha")["status"]["phase"] == "Provisioning"
    assert not any(t.done() for t in tasks)


async def test_a_second_object_for_a_taken_tenant_name_is_refused_on_its_own_status(apiserver, kube, manager):
    mgr, _ = manager
    await kubectl_apply(kube, manifest("delta", {}))
    await eventually(lambda: (apiserver.object(*TCP, "delta", NAMESPACE) or {}).get("status"), what="delta's status")
    await apiserver.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-b"}})
    other = yaml.safe_load(manifest("delta", {"quota": {"gpus": 100}}))
    other["metadata"]["namespace"] = "team-b"
    await kubectl_apply(kube, yaml.safe_dump(other))
    refused = await eventually(lambda: (apiserver.object(*TCP, "delta", "team-b") or {}).get("status")
                               and apiserver.object(*TCP, "delta", "team-b"), what="the second object's status")
    ready = condition(refused, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "Conflict" and "team-a/delta" in ready["message"]
    assert (await mgr.store.tenants.get("delta")).value.quota.gpus is None  # the first object's, untouched
    # and deleting the second object does not take the first one's tenant with it
    await kube.delete(f"/apis/{TCP[0]}/namespaces/team-b/{crd.PLURAL}/delta")
    await eventually(lambda: apiserver.object(*TCP, "delta", "team-b") is None, what="the second object gone")
    assert await mgr.store.controlplanes.get("delta") is not None


async def test_the_real_kubectl_applies_gets_and_deletes_a_tenant_control_plane(apiserver, manager):
    mgr, _ = manager
    rc, out, err = await kubectl(apiserver.url, "apply", "-f", "-", stdin=manifest("omega", {"quota": {"gpus": 1}}))
    assert rc == 0 and out.strip() == "tenantcontrolplane.tessera.io/omega created", err
    await eventually(lambda: (apiserver.object(*TCP, "omega", NAMESPACE) or {}).get("status"), what="omega's status")

    rc, out, err = await kubectl(apiserver.url, "get", "tcp", "-n", NAMESPACE)
    assert rc == 0, err
    header, row = out.splitlines()
    assert header.split() == ["NAME", "PHASE", "READY", "ENDPOINT", "AGE"]
    starts = [header.index(name) for name in header.split()] + [None]
    cells = {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, starts[1:])}
    assert cells["NAME"] == "omega" and cells["PHASE"] == "Provisioning"
    assert cells["ENDPOINT"] == "https://omega-apiserver.tenant-omega.svc:6443"
    # (the emulator's Table evaluates plain dotted paths only; kubectl's own JSONPath evaluates the
    # Ready column's filter expression, as the real API server's printer does)
    ready = next(c for c in crd.definition()["spec"]["versions"][0]["additionalPrinterColumns"] if c["name"] == "Ready")
    rc, out, err = await kubectl(apiserver.url, "get", "tcp", "omega", "-n", NAMESPACE,
                                 "-o", "jsonpath={" + ready["jsonPath"] + "}")
    assert rc == 0 and out == "False", (out, err)
    rc, out, err = await kubectl(apiserver.url, "get", "tcp", "-n", NAMESPACE, "-o", "wide")
    assert rc == 0 and "WaitingForControlPlane" in out, err

    rc, out, err = await kubectl(apiserver.url, "delete", "tcp", "omega", "-n", NAMESPACE)  # waits for the finalizer
    assert rc == 0 and 'tenantcontrolplane.tessera.io "omega" deleted' in out, err
    assert apiserver.object(*TCP, "omega", NAMESPACE) is None
    assert await mgr.store.tenants.get("omega") is None
