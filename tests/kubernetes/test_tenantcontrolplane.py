"""`kubectl apply -f` of a TenantControlPlane on the real control plane of the tests (v1.36), with a
real NATS: the manager, acting as deploy/k8s/controlplane/manager.yaml's ServiceAccount, creates the
tenant, writes its status (phase, endpoint, conditions, observedGeneration) through the status
subresource, changes its quota on an update, reports an invalid spec on the object naming the field
while it goes on serving others, and on delete (its finalizer) removes everything the tenant had
before the object goes.

Ready is the tenant's API server answering: no kubelet runs the Deployment's pods here, so where a
test needs Ready the manager runs the pod the host stores as local processes (`LocalKubelet`,
TESSERA_CP_KUBE_PODS=local); elsewhere the pods stay Pending, as on a cluster with no room for them,
and the tenant Provisioning. The session's plane is shared: each test's tenants and namespaces have
names of their own, and its objects are gone (the manager tears them down) when it ends."""

from __future__ import annotations

import asyncio
import base64
import re
import uuid
from contextlib import asynccontextmanager

import pytest
import yaml

from tessera.controlplane import crd
from tessera.controlplane.app import Manager
from tessera.controlplane.datastores.natskv import NatsKvDriver
from tessera.controlplane.kube import KubeHost, UsersSecret
from tessera.controlplane.localkubelet import LocalKubelet
from tessera.controlplane.localplanes import LocalControlPlanes
from tessera.controlplane.resources import FINALIZER
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared.bus import Bus
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.kubeapi import Invalid, KubeApi, NotFound, object_path
from tessera.shared.settings import BusSettings

import kube_rbac
from controlplane.planes import binaries  # noqa: F401 - a fixture, registered by being here
from kit import eventually
from kit.kubecluster import apply, manifests, service_identity

API = f"{crd.GROUP}/{crd.VERSION}"
MANAGER = "system:serviceaccount:tessera-system:tessera-controlplane"


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


def manifest(name: str, namespace: str, spec: dict) -> str:
    """The YAML a user keeps and hands to `kubectl apply -f`."""
    return yaml.safe_dump({"apiVersion": API, "kind": "TenantControlPlane",
                           "metadata": {"name": name, "namespace": namespace}, "spec": spec})


def tcp(namespace: str, name: str | None = None) -> str:
    return object_path(API, crd.PLURAL, name, namespace)


async def kubectl_apply(kube: KubeApi, text: str) -> dict:
    """`kubectl apply --server-side -f`: the file's YAML as an apply patch under kubectl's manager."""
    doc = yaml.safe_load(text)
    return await kube.call("PATCH", tcp(doc["metadata"]["namespace"], doc["metadata"]["name"]), doc,
                           query=[("fieldManager", "kubectl")], content_type="application/apply-patch+yaml")


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


async def users_listed(admin: KubeApi) -> str:
    secret = await admin.get(object_path("v1", "secrets", "tessera-nats-users", "tessera-system"))
    return base64.b64decode(secret["data"]["users.conf"]).decode() if secret else ""



@pytest.fixture
def start_manager(kube_plane, plane_namespace, admin, nats_url, binaries, tmp_path):  # noqa: F811
    """``async with start_manager(run_pods=...) as (manager, tasks)``: the manager as manager.yaml runs
    it (Kubernetes host, NATS datastore users kept in a Secret), as its ServiceAccount; with
    ``run_pods`` it also plays the kubelet's part for the tenants' pods. When it ends, every
    TenantControlPlane in the test's namespaces is deleted and its tenant torn down by the manager."""
    apply(kube_plane, manifests("crds/tenantcontrolplanes.yaml"))
    identity = str(service_identity(kube_plane, "controlplane/manager.yaml"))

    @asynccontextmanager
    async def started(run_pods: bool = False, namespaces: tuple[str, ...] = ()):
        bus = await Bus.connect(BusSettings(url=nats_url, file_storage=False), "controlplane")
        await bus.ensure_topology()
        host = KubeHost(KubeApi.for_kubeconfig(identity))
        if run_pods:
            kube_bin, kine_bin = binaries
            host = LocalKubelet(host, LocalControlPlanes(tmp_path / "planes", kube_bin, kine_bin, stop_on_close=True))
        users = UsersSecret("tessera-system/tessera-nats-users", kube=KubeApi.for_kubeconfig(identity))
        mgr = await Manager.start(bus, ControlPlaneSettings(host_mode="kubernetes"), host=host,
                                  drivers={"nats": NatsKvDriver(bus, nats_url, users)})
        roots = mgr.root_tasks()  # the watches and the TenantControlPlane objects, as the manager runs them
        roots.pop("resync").close()  # (not the periodic resync: what follows is driven by watches alone)
        tasks = [asyncio.create_task(coro, name=name) for name, coro in roots.items()]
        try:
            yield mgr, tasks
        finally:
            try:
                await _delete_all(admin, (plane_namespace, *namespaces))
            finally:
                # Not one cancel each: a task cancelled while a NATS reply arrives may live through it
                # (Python 3.11's wait_for) and watch on forever (`tessera.shared.cancelling`).
                await cancel_and_wait(tasks)
                await mgr.close()
                await bus.close()
                await _forget(admin, (plane_namespace, *namespaces))

    return started


async def _delete_all(admin: KubeApi, namespaces: tuple[str, ...]) -> None:
    """Every TenantControlPlane of ``namespaces`` deleted, and gone once the manager let it go."""
    for ns in namespaces:
        for obj in (await admin.list(tcp(ns)))[0]:
            await admin.delete(tcp(ns, obj["metadata"]["name"]))

    async def none_left() -> bool:
        return not [obj for ns in namespaces for obj in (await admin.list(tcp(ns)))[0]]

    await eventually(none_left, timeout=60, what="the test's TenantControlPlanes torn down")


async def _forget(admin: KubeApi, namespaces: tuple[str, ...]) -> None:
    """What a failed test left behind goes, finalizer and all: no later test's manager serves it."""
    for ns in namespaces:
        for obj in (await admin.list(tcp(ns)))[0]:
            try:
                await admin.patch(tcp(ns, obj["metadata"]["name"]), {"metadata": {"finalizers": None}})
                await admin.delete(tcp(ns, obj["metadata"]["name"]))
            except NotFound:
                pass


@pytest.mark.timeout(600)
async def test_apply_creates_the_tenant_status_follows_update_changes_quota_delete_cleans_up(
        kube_plane, plane_namespace, admin, start_manager):
    name, ns = unique("alpha"), plane_namespace
    tenant_ns = f"tenant-{name}"
    seen = len(kube_plane.audit())
    async with start_manager(run_pods=True) as (mgr, tasks):
        async def obj():
            return await admin.get(tcp(ns, name))

        async def status(phase: str):
            got = await obj()
            return got if (got or {}).get("status", {}).get("phase") == phase else None

        await kubectl_apply(admin, manifest(name, ns, {"quota": {"gpus": 4},
                                                       "network": {"nodeCidrs": ["192.168.7.0/24"]}}))
        provisioning = await eventually(lambda: status("Provisioning"), what="Provisioning")
        assert FINALIZER in provisioning["metadata"]["finalizers"]
        endpoint = f"https://{name}-apiserver.{tenant_ns}.svc:6443"
        assert provisioning["status"]["endpoint"] == endpoint
        assert provisioning["status"]["observedGeneration"] == provisioning["metadata"]["generation"] == 1
        ready = condition(provisioning, "Ready")
        assert ready["status"] == "False" and ready["reason"] == "WaitingForControlPlane"
        assert condition(provisioning, "Valid")["status"] == "True"
        assert (await mgr.store.tenants.get(name)).value.quota.gpus == 4  # the quota placement reads
        assert f'"user": "tenant-{name}"' in await users_listed(admin)  # its datastore user, for nats-server
        assert await admin.get(object_path("apps/v1", "deployments", f"{name}-control-plane", tenant_ns))
        assert await admin.get(object_path("v1", "secrets", f"{name}-datastore", tenant_ns))

        # Ready once the tenant's API server, run from the pod the host stores, answers /readyz
        shown = await eventually(lambda: status("Ready"), timeout=300, every=0.5, what="Ready")
        assert condition(shown, "Ready")["status"] == "True"
        discovery = await admin.call("GET", f"/apis/{API}")  # what `kubectl get tcp` resolves the short name by
        assert "tcp" in next(r for r in discovery["resources"] if r["name"] == crd.PLURAL)["shortNames"]
        assert printer_columns(shown) == {"Phase": "Ready", "Ready": "True", "Endpoint": endpoint,
                                          "Age": shown["metadata"]["creationTimestamp"]}

        await kubectl_apply(admin, manifest(name, ns, {"quota": {"gpus": 8},
                                                       "network": {"nodeCidrs": ["192.168.7.0/24"]}}))

        async def observed_two():
            return ((await obj()) or {}).get("status", {}).get("observedGeneration") == 2

        await eventually(observed_two, what="generation 2 observed")
        assert (await mgr.store.tenants.get(name)).value.quota.gpus == 8

        await admin.delete(tcp(ns, name))

        async def gone():
            return await obj() is None

        await eventually(gone, timeout=60, what="the object gone once the finalizer is removed")
        assert await mgr.store.controlplanes.get(name) is None
        assert await mgr.store.secrets.get(name) is None  # credentials
        assert await mgr.store.tenants.get(name) is None  # quota
        assert await admin.get(object_path("apps/v1", "deployments", f"{name}-control-plane", tenant_ns)) is None
        assert await admin.get(object_path("v1", "secrets", f"{name}-datastore", tenant_ns)) is None
        namespace = await admin.get(object_path("v1", "namespaces", tenant_ns))
        assert namespace is None or namespace["metadata"].get("deletionTimestamp")
        assert not any(t.done() for t in tasks)
        assert f"tenant-{name}" not in await users_listed(admin)  # its datastore user revoked

    # the manager's ClusterRole grants exactly what it called (the server refused none of it)
    role = next(d for d in manifests("controlplane/manager.yaml") if d["kind"] == "ClusterRole")
    events = kube_plane.audit()[seen:]
    assert [(e["verb"], e["requestURI"]) for e in events
            if e["user"]["username"] == MANAGER and e["responseStatus"]["code"] == 403] == []
    # (`bind` is checked when the manager creates a tenant's RoleBinding, never a request of its own:
    # test_tenant_pods_managed.py shows the real server accepting the binding the manager makes)
    kube_rbac.check_audited(events, MANAGER, role,
                            elsewhere=frozenset({("rbac.authorization.k8s.io", "clusterroles", "bind")}))


async def test_an_invalid_spec_is_a_condition_naming_the_field_and_the_manager_goes_on(
        plane_namespace, admin, start_manager):
    ns = plane_namespace
    alpha, beta, gamma = unique("alpha"), unique("beta"), unique("gamma")
    async with start_manager() as (mgr, tasks):
        async def get(name: str):
            return await admin.get(tcp(ns, name))

        async def with_status(name: str):
            got = await get(name)
            return got if (got or {}).get("status") else None

        # what the CRD's schema cannot say: the pod range overlaps the service range
        await kubectl_apply(admin, manifest(beta, ns, {"network": {"serviceCidr": "10.96.0.0/16",
                                                                   "podCidr": "10.96.0.0/12"}}))
        refused = await eventually(lambda: with_status(beta), what="beta's status")
        valid = condition(refused, "Valid")
        assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
        assert valid["message"].startswith("$.spec.network.podCidr: ")
        assert refused["status"]["phase"] == "NotReady" and await mgr.store.controlplanes.get(beta) is None
        # what the schema can say is refused by the API server itself, naming the field
        with pytest.raises(Invalid, match=r"spec.quota.gpus"):
            await kubectl_apply(admin, manifest(gamma, ns, {"quota": {"gpus": -1}}))

        # the manager serves the others meanwhile, and a fixed spec is taken
        async def phase(name: str, wanted: str):
            got = await get(name)
            return got if (got or {}).get("status", {}).get("phase") == wanted else None

        await kubectl_apply(admin, manifest(alpha, ns, {"quota": {"gpus": 2}}))
        await eventually(lambda: phase(alpha, "Provisioning"), what="alpha served")
        await kubectl_apply(admin, manifest(beta, ns, {"network": {"podCidr": "10.244.0.0/16"}}))

        async def fixed():
            got = await get(beta)
            return got if condition(got, "Valid")["status"] == "True" else None

        assert (await eventually(fixed, what="beta fixed"))["status"]["phase"] == "Provisioning"
        assert await mgr.store.controlplanes.get(beta) is not None

        # a change that breaks a working tenant's spec is refused and leaves the tenant as it was
        bad = {"quota": {"gpus": 3}, "resources": {"scheduler": {"requests": {"cpuMillis": 200, "memoryMib": 128},
                                                                 "limits": {"cpuMillis": 100, "memoryMib": 128}}}}
        await kubectl_apply(admin, manifest(alpha, ns, bad))

        async def alpha_refused():
            return condition(await get(alpha), "Valid")["status"] == "False"

        await eventually(alpha_refused, what="alpha refused")
        assert "$.spec.resources.scheduler.limits.cpuMillis" in condition(await get(alpha), "Valid")["message"]
        assert (await mgr.store.tenants.get(alpha)).value.quota.gpus == 2
        assert (await get(alpha))["status"]["phase"] == "Provisioning"
        assert not any(t.done() for t in tasks)


async def test_a_second_object_for_a_taken_tenant_name_is_refused_on_its_own_status(
        kube_plane, plane_namespace, admin, start_manager):
    name, first = unique("delta"), plane_namespace
    second = unique("team-b")
    await asyncio.to_thread(kube_plane.kubectl, "create", "namespace", second)
    try:
        async with start_manager(namespaces=(second,)) as (mgr, _):
            async def status_of(ns: str):
                got = await admin.get(tcp(ns, name))
                return got if (got or {}).get("status") else None

            await kubectl_apply(admin, manifest(name, first, {}))
            await eventually(lambda: status_of(first), what="the first object's status")
            await kubectl_apply(admin, manifest(name, second, {"quota": {"gpus": 100}}))
            refused = await eventually(lambda: status_of(second), what="the second object's status")
            ready = condition(refused, "Ready")
            assert ready["status"] == "False" and ready["reason"] == "Conflict" and f"{first}/{name}" in ready["message"]
            assert (await mgr.store.tenants.get(name)).value.quota.gpus is None  # the first object's, untouched
            # and deleting the second object does not take the first one's tenant with it
            await admin.delete(tcp(second, name))

            async def second_gone():
                return await admin.get(tcp(second, name)) is None

            await eventually(second_gone, what="the second object gone")
            assert await mgr.store.controlplanes.get(name) is not None
    finally:
        await asyncio.to_thread(kube_plane.kubectl, "delete", "namespace", second, "--wait=false", check=False)


async def test_the_real_kubectl_applies_gets_and_deletes_a_tenant_control_plane(
        kube_plane, plane_namespace, start_manager):
    name, ns = unique("omega"), plane_namespace

    async def kubectl(*args: str, stdin: str | None = None):
        return await asyncio.to_thread(kube_plane.kubectl, *args, stdin=stdin, check=False)

    async with start_manager() as (mgr, _):
        done = await kubectl("apply", "-f", "-", stdin=manifest(name, ns, {"quota": {"gpus": 1}}))
        assert done.returncode == 0 and done.stdout.strip() == f"tenantcontrolplane.tessera.io/{name} created", done.stderr

        async def phase_shown():
            got = await kubectl("get", "tcp", name, "-n", ns, "-o", "jsonpath={.status.phase}")
            return got.stdout == "Provisioning"

        await eventually(phase_shown, what="its status")
        done = await kubectl("get", "tcp", "-n", ns)  # the real server's Table, from the CRD's columns
        assert done.returncode == 0, done.stderr
        header, row = done.stdout.splitlines()
        assert header.split() == ["NAME", "PHASE", "READY", "ENDPOINT", "AGE"]
        starts = [header.index(column) for column in header.split()] + [None]
        cells = {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, starts[1:])}
        assert cells["NAME"] == name and cells["PHASE"] == "Provisioning" and cells["READY"] == "False"
        assert cells["ENDPOINT"] == f"https://{name}-apiserver.tenant-{name}.svc:6443"
        done = await kubectl("get", "tcp", "-n", ns, "-o", "wide")
        assert done.returncode == 0 and "WaitingForControlPlane" in done.stdout, done.stderr

        done = await kubectl("delete", "tcp", name, "-n", ns)  # waits for the finalizer
        assert done.returncode == 0 and f'tenantcontrolplane.tessera.io "{name}" deleted' in done.stdout, done.stderr
        assert (await kubectl("get", "tcp", name, "-n", ns)).returncode != 0
        assert await mgr.store.tenants.get(name) is None
