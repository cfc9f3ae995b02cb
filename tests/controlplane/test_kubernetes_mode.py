"""Kubernetes mode on the real control plane of the tests (kube-apiserver v1.36, its controllers):
the manager, acting as deploy/k8s/controlplane/manager.yaml's ServiceAccount with that file's RBAC,
applies a tenant's Namespace, Secrets, Deployment (API server, controller manager, scheduler, and
kine where the datastore needs it), Service and NetworkPolicy with server-side apply; no kubelet
runs those pods here, so the manager runs the pod the host cluster stores as local processes
(`LocalKubelet`), and the tenant is Ready only once that API server answers ``/readyz`` with the
tenant's CA. Then kubectl works as the tenant, and deleting the tenant removes it all."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tessera.cli.client import Client
from tessera.cli.tenant import render_detail
from tessera.cli.cluster import LocalCluster
from tessera.controlplane import crd, manifests
from tessera.controlplane.app import Manager, make_host
from tessera.controlplane.kube import KubeHost
from tessera.controlplane.localkubelet import LocalKubelet
from tessera.controlplane.localpod import Ports, translate
from tessera.controlplane.resources import FINALIZER
from tessera.controlplane.settings import ControlPlaneSettings
from tessera.shared import subjects
from tessera.shared.api import SubmitRequest
from tessera.shared.errors import ConfigError
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.kubeapi import KubeApi, NotFound, object_path
from tessera.shared.ledger import Ledger

from controlplane.planes import Planes, port_free, processes_marked
from kit import eventually
from kit.kubecluster import apply, manifests as deployed, service_identity

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
MANAGER = "system:serviceaccount:tessera-system:tessera-controlplane"
KINDS = (("v1", "secrets"), ("v1", "services"), ("apps/v1", "deployments"),
         ("networking.k8s.io/v1", "networkpolicies"))


async def stored(admin: KubeApi, tenant: str) -> dict[tuple[str, str], dict]:
    """(kind, name) -> the tenant's namespace and what is in it, as the host cluster holds them now."""
    ns = manifests.namespace(tenant)
    out = {}
    for api_version, plural in KINDS:
        for obj in (await admin.list(object_path(api_version, plural, None, ns)))[0]:
            out[(obj["kind"], obj["metadata"]["name"])] = obj
    namespace = await admin.get(object_path("v1", "namespaces", ns))
    if namespace is not None and not namespace["metadata"].get("deletionTimestamp"):
        out[("Namespace", ns)] = namespace
    return out


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


async def readyz(port: int, pki: dict[str, str], server_name: str, directory: Path) -> str:
    """``/readyz`` over TLS checked against the tenant's CA (from the Secret the host holds), as its admin."""
    for name in ("ca.crt", "admin.crt", "admin.key"):
        (directory / name).write_text(pki[name])
    ctx = ssl.create_default_context(cafile=str(directory / "ca.crt"))
    ctx.load_cert_chain(str(directory / "admin.crt"), str(directory / "admin.key"))
    async with aiohttp.ClientSession() as session:
        async with session.get(f"https://127.0.0.1:{port}/readyz?verbose", ssl=ctx,
                               server_hostname=server_name) as resp:
            return f"{resp.status} {await resp.text()}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kube_mode", ["etcd", "postgres", "nats"], indirect=True)
async def test_the_pod_the_host_cluster_stores_serves_the_tenant(kube_mode: Planes, kube_plane, tmp_path):
    planes = kube_mode
    tenant = f"k{uuid.uuid4().hex[:8]}"
    admin = KubeApi.for_kubeconfig(str(kube_plane.admin_kubeconfig))
    audited = len(kube_plane.audit())
    try:
        record = await planes.create(tenant)  # Ready: its API server answered /readyz with its CA
        service = f"{tenant}-apiserver.{manifests.namespace(tenant)}.svc"
        assert record.status.endpoint == f"https://{service}:6443"  # the Service, as on any cluster

        objects = await stored(admin, tenant)
        assert sorted(kind for kind, _ in objects) == ["Deployment", "Namespace", "NetworkPolicy", "Secret",
                                                       "Secret", "Secret", "Service"]
        deployment = objects[("Deployment", f"{tenant}-control-plane")]
        containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
        shim = {"etcd": set(), "postgres": {"datastore-shim"}, "nats": {"datastore-shim"}}[planes.driver]
        assert set(containers) == {"kube-apiserver", "kube-controller-manager", "kube-scheduler"} | shim
        for container in containers.values():
            assert set(container["resources"]) == {"requests", "limits"}, container["name"]
        rendered = next(o for o in manifests.render(record, await planes.secrets(tenant), "tessera-system")
                        if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
        assert rendered["resources"]["limits"] == {"cpu": "1000m", "memory": "1024Mi"}  # what the manager sent,
        assert containers["kube-apiserver"]["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}  # what is kept
        policy = objects[("NetworkPolicy", f"{tenant}-apiserver-ingress")]
        assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 6443}]

        # what runs is what the host stores: each process's command line is its container's, read
        # back from the API server (defaulted, quantities canonical), moved only where a pod's own
        # network namespace would have it
        local = planes.host
        plane = local._read(tenant)
        secrets = [o for (kind, _), o in objects.items() if kind == "Secret"]
        pod = translate([deployment, *secrets], local.home(tenant), Ports(plane.apiserver_port, plane.shim_port))
        for process in pod.processes:
            assert cmdline(local.pids(tenant)[process.name])[1:] == process.argv, process.name
        apiserver = next(p for p in pod.processes if p.name == "kube-apiserver")
        assert (apiserver.cpu_millis, apiserver.memory_bytes) == (1000, 1024**3)  # the canonical quantities read
        # the real ReplicaSet controller made the pods, which no kubelet runs, admitted under Pod
        # Security "restricted", which the tenant's namespace enforces
        labels = objects[("Namespace", manifests.namespace(tenant))]["metadata"]["labels"]
        assert labels["pod-security.kubernetes.io/enforce"] == "restricted", labels
        pods, _ = await admin.list(object_path("v1", "pods", None, manifests.namespace(tenant)))
        assert len(pods) == deployment["spec"]["replicas"] and {p["status"]["phase"] for p in pods} == {"Pending"}

        # the tenant's API server answers with the tenant's CA, under the Service's name
        pki = await planes.pki(tenant)
        answer = await readyz(plane.apiserver_port, pki, service, tmp_path)
        assert answer.startswith("200 ") and "readyz check passed" in answer, answer
        # kubectl with the tenant's kubeconfig (`tessera tenant kubeconfig`), reaching the Service's
        # pod on its forwarded port (what `kubectl port-forward` gives), TLS checked against the name
        kubeconfig = await planes.kubeconfig(tenant, tmp_path)
        forwarded = (f"--server=https://127.0.0.1:{plane.apiserver_port}", f"--tls-server-name={service}")
        listed = await planes.kubectl(kubeconfig, *forwarded, "get", "ns")
        assert listed.returncode == 0 and "kube-system" in listed.stdout, listed.stderr
        made = await planes.kubectl(kubeconfig, *forwarded, "create", "namespace", "scratch")
        assert made.returncode == 0, made.stderr
        # the in-pod controller manager reached its API server: the new namespace's ServiceAccount
        async def account() -> bool:
            done = await planes.kubectl(kubeconfig, *forwarded, "get", "serviceaccount", "default", "-n", "scratch")
            return done.returncode == 0

        await eventually(account, timeout=120, every=1, what="the controller manager")

        # and the in-pod scheduler too: it holds its lease
        lease = await planes.kubectl(kubeconfig, *forwarded, "get", "lease", "-n", "kube-system", "kube-scheduler",
                                     "-o", "jsonpath={.spec.holderIdentity}")
        assert lease.returncode == 0 and lease.stdout, lease.stderr

        # the processes are watched as a kubelet watches containers: a killed API server is started
        # again from the stored pod, and the tenant's objects are still there
        pid = local.pids(tenant)["kube-apiserver"]
        os.kill(pid, signal.SIGKILL)
        await planes.wait_phase(tenant, "NotReady", "ProcessExited", timeout=60)
        await planes.wait_phase(tenant, "Ready")
        assert local.pids(tenant)["kube-apiserver"] != pid
        kept = await planes.kubectl(kubeconfig, *forwarded, "get", "namespace", "scratch")
        assert kept.returncode == 0, kept.stderr

        # a resync applies the same objects again: the host stores nothing new
        versions = {key: o["metadata"]["resourceVersion"] for key, o in objects.items()}
        await planes.manager.reconciler.reconcile(tenant)
        assert {k: o["metadata"]["resourceVersion"] for k, o in (await stored(admin, tenant)).items()} == versions

        # deleting the tenant removes its objects from the host and its processes and files here
        ports = [plane.apiserver_port, plane.shim_port]
        removal = await planes.manager.api.remove(tenant)
        assert not removal.pending
        assert await stored(admin, tenant) == {}
        assert processes_marked(str(local.home(tenant))) == [] and not local.home(tenant).exists()
        assert [p for p in ports if not port_free(p)] == []

        # the manager's RBAC as deployed: the server refused none of its calls
        events = kube_plane.audit()[audited:]
        refused = [(e["verb"], e["requestURI"]) for e in events
                   if e["user"]["username"] == MANAGER and e["responseStatus"]["code"] == 403]
        assert refused == []
    finally:
        await admin.close()
CONFIGMAP = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: dream, namespace: default}\ndata: {kept: 'yes'}\n"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kube_mode", ["nats"], indirect=True)
async def test_a_sleeping_tenant_is_scaled_to_zero_on_the_host_and_wakes_with_its_data(kube_mode: Planes, kube_plane,
                                                                                        tmp_path):
    planes = kube_mode
    await asyncio.to_thread(apply, kube_plane, deployed("controlplane/tenant-pods.yaml"))  # (its pod syncer's RBAC)
    tenant = f"k{uuid.uuid4().hex[:8]}"
    ns = manifests.namespace(tenant)
    admin = KubeApi.for_kubeconfig(str(kube_plane.admin_kubeconfig))
    deployment = object_path("apps/v1", "deployments", f"{tenant}-control-plane", ns)
    try:
        record = await planes.create(tenant)
        local = planes.host
        plane = local._read(tenant)
        service = f"{tenant}-apiserver.{ns}.svc"
        kubeconfig = await planes.kubeconfig(tenant, tmp_path)
        forwarded = (f"--server=https://127.0.0.1:{plane.apiserver_port}", f"--tls-server-name={service}")
        made = await planes.kubectl(kubeconfig, *forwarded, "apply", "-f", "-", stdin=CONFIGMAP)
        assert made.returncode == 0, made.stderr

        async def syncing() -> bool:
            return (await planes.record(tenant)).status.gpu_pods == "Syncing"  # type: ignore[union-attr]

        await eventually(syncing, timeout=120, what="the tenant's GPU pod syncer")

        # `tessera tenant sleep`: the Deployment on the host is scaled to zero, the real ReplicaSet
        # controller removes its pods, and the manager, in the kubelet's part, stops the processes
        asleep = await planes.call("sleep", tenant)
        assert asleep.ok, asleep.error
        shown = asleep.result["tenant"]
        assert (shown["phase"], shown["reason"], shown["gpu_pods"]) == ("NotReady", "Sleeping", ""), shown
        assert (await admin.get(deployment))["spec"]["replicas"] == 0
        assert local.pids(tenant) == {} and processes_marked(str(local.home(tenant))) == []

        async def no_pods() -> bool:
            return (await admin.list(object_path("v1", "pods", None, ns)))[0] == []

        await eventually(no_pods, timeout=60, what="the ReplicaSet controller removing the pods")
        refused = await planes.kubectl(kubeconfig, *forwarded, "get", "ns")
        assert refused.returncode != 0 and "refused" in refused.stderr, refused.stderr
        # `tessera tenant get` says so
        got = await planes.call("get", tenant)
        assert got.ok and got.result["asleep"] is True, got
        assert "Sleeping" in render_detail(got.result) and "0 (asleep" in render_detail(got.result)

        # a resync leaves a sleeping tenant's Deployment as it is
        version = (await admin.get(deployment))["metadata"]["resourceVersion"]
        await planes.manager.reconciler.resync()
        after = await admin.get(deployment)
        assert (after["spec"]["replicas"], after["metadata"]["resourceVersion"]) == (0, version)
        assert local.pids(tenant) == {}

        # `tessera tenant wake`: back to the spec's replicas, Ready once its API server answers with
        # the tenant's CA and reads through its datastore; the objects made before the sleep are there
        awake = await planes.call("wake", tenant)
        assert awake.ok, awake.error
        assert awake.result["tenant"]["phase"] == "Ready" and awake.result["seconds"] > 0, awake.result
        woken = await planes.record(tenant)
        assert woken is not None and woken.status.wake_seconds > 0, woken
        assert (await admin.get(deployment))["spec"]["replicas"] == record.spec.kubernetes.replicas
        plane = local._read(tenant)
        forwarded = (f"--server=https://127.0.0.1:{plane.apiserver_port}", f"--tls-server-name={service}")
        kept = await planes.kubectl(kubeconfig, *forwarded, "get", "configmap", "dream", "-o",
                                    "jsonpath={.data.kept}")
        assert kept.stdout == "yes", kept.stderr
        await eventually(syncing, timeout=120, what="the syncer running again after a wake")
        reasons = await planes.reasons(tenant)
        slept = reasons.index("Sleeping")
        assert reasons[slept:].index("Waking") < reasons[slept:].index("Ready"), reasons
        print(f"wake in Kubernetes mode: {woken.status.wake_seconds:.2f} s until Ready")

        # the idle timeout (TESSERA_CP_IDLE_SECONDS, which the host reads as it goes) scales it to zero
        # the same way, although the tenant's syncer keeps its virtual node Ready (a lease every 10 s,
        # the node's status every minute: the platform's own doing, not the tenant's use)
        local.idle_seconds = 70.0
        try:
            await planes.wait_phase(tenant, "NotReady", "Sleeping", timeout=200)
        finally:
            local.idle_seconds = 0.0
        assert (await admin.get(deployment))["spec"]["replicas"] == 0 and local.pids(tenant) == {}

        # a sleep while a wake is in flight wins, and the wake says so. The API server's answer is
        # held back until the second sleep is sent, so the wake cannot finish first by chance.
        assert (await planes.call("sleep", tenant)).ok
        answering = local.probe
        slept_again = asyncio.Event()

        async def held_probe(name: str, *args: Any, **kwargs: Any) -> str | None:
            if name == tenant and not slept_again.is_set():
                return "held back by the test until the tenant is put to sleep again"
            return await answering(name, *args, **kwargs)

        local.probe = held_probe  # type: ignore[method-assign]
        try:
            waking = asyncio.create_task(planes.call("wake", tenant))

            async def marked() -> bool:
                return (await planes.record(tenant)).status.reason == "Waking"  # type: ignore[union-attr]

            await eventually(marked, timeout=60, what="the wake under way")
            assert (await planes.call("sleep", tenant)).ok
            slept_again.set()
            interrupted = await waking
        finally:
            local.probe = answering  # type: ignore[method-assign]
        assert not interrupted.ok and interrupted.error.code == "conflict", interrupted
        assert "put to sleep" in interrupted.error.message
        assert (await admin.get(deployment))["spec"]["replicas"] == 0

        # a deleted tenant cannot be woken
        assert not (await planes.manager.api.remove(tenant)).pending
        gone = await planes.call("wake", tenant)
        assert not gone.ok and gone.error.code == "not-found", gone
    finally:
        await admin.close()


# --- deleting a TenantControlPlane whose tenant still has claims ----------------------------------

GPUMEM = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}


@pytest.fixture
async def gpu_services(nats_url, tmp_path):
    """Capacity, translator, placement and the enforcers of tests/profiles/tiny.yaml (simulated
    hardware) as processes on this test's nats-server: the real services that hold and release claims."""
    cluster = LocalCluster(workdir=tmp_path / "services", profile=PROFILES / "tiny.yaml", nats_url=nats_url,
                           extra_env={"TESSERA_STREAM_STORAGE": "memory"})  # as the in-loop manager's bus
    try:
        for name in ("capacity", "translator", "placement"):
            cluster.spawn(name, instance=name)
        for node in cluster.nodes():
            cluster.spawn("enforcer", instance=f"enforcer-{node}", env={"TESSERA_NODE": node})
        await asyncio.to_thread(cluster.wait_ready, 90)
        yield cluster
    finally:
        await asyncio.to_thread(cluster.stop)


def test_running_the_pods_without_a_kubelet_needs_a_directory_and_is_what_the_manager_builds(tmp_path):
    from tessera.shared.secretkeys import write_key_file

    write_key_file(tmp_path / "keys")
    env = {"TESSERA_CP_HOST": "kubernetes", "TESSERA_CP_KUBE_PODS": "local", "TESSERA_CP_SECRET_KEY_FILE":
           str(tmp_path / "keys")}
    with pytest.raises(ConfigError, match="TESSERA_CP_KUBE_PODS=local needs TESSERA_CP_CONTROL_PLANES_DIR"):
        ControlPlaneSettings.from_env(env)
    with pytest.raises(ConfigError, match="TESSERA_CP_KUBE_PODS"):
        ControlPlaneSettings.from_env({**env, "TESSERA_CP_KUBE_PODS": "containerd"})
    settings = ControlPlaneSettings.from_env({**env, "TESSERA_CP_CONTROL_PLANES_DIR": str(tmp_path / "planes"),
                                              "TESSERA_CP_KUBE_BIN_DIR": "/opt/kube", "TESSERA_CP_CGROUP_ROOT": ""})
    host = make_host(settings)
    assert isinstance(host, LocalKubelet) and isinstance(host.kube, KubeHost)
    assert (host.planes.directory, host.planes.binary("kube-apiserver")) == (tmp_path / "planes",
                                                                             Path("/opt/kube/kube-apiserver"))
    assert isinstance(make_host(ControlPlaneSettings.from_env(env | {"TESSERA_CP_KUBE_PODS": "kubelet"})), KubeHost)


@pytest.fixture
def manager_identity(kube_plane) -> Path:
    """The manager's deploy/k8s ServiceAccount (its RBAC applied) and the CRD, as the operator installs them."""
    apply(kube_plane, deployed("crds/tenantcontrolplanes.yaml"))
    return service_identity(kube_plane, "controlplane/manager.yaml")


async def test_a_deleted_tenant_control_plane_keeps_its_finalizer_until_its_claims_are_released(
        kube_plane, plane_namespace, manager_identity, bus, gpu_services):
    # (the Deployment's pods are run by no one here: the tenant stays Provisioning, which is all this needs)
    cluster = gpu_services
    tenant = f"k{uuid.uuid4().hex[:8]}"
    settings = ControlPlaneSettings(host_mode="kubernetes", teardown_wait_seconds=1.0, resync_seconds=0.5)
    mgr = await Manager.start(bus, settings, host=KubeHost(KubeApi.for_kubeconfig(str(manager_identity))))
    tasks = [asyncio.create_task(coro, name=name) for name, coro in mgr.root_tasks().items()]
    client = await Client.connect(cluster.url)
    admin = KubeApi.for_kubeconfig(str(kube_plane.admin_kubeconfig))
    path = object_path(f"{crd.GROUP}/{crd.VERSION}", crd.PLURAL, tenant, plane_namespace)
    deployment = object_path("apps/v1", "deployments", f"{tenant}-control-plane", manifests.namespace(tenant))
    try:
        await admin.create(object_path(f"{crd.GROUP}/{crd.VERSION}", crd.PLURAL, None, plane_namespace),
                           {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": "TenantControlPlane",
                            "metadata": {"name": tenant, "namespace": plane_namespace},
                            "spec": {"quota": {"gpus": 2}, "network": {"nodeCidrs": ["192.168.7.0/24"]}}})
        await eventually(lambda: admin.get(path), what="the object")
        await eventually(lambda: mgr.store.tenants.get(tenant), what="the tenant served")
        assert (await mgr.store.tenants.get(tenant)).value.quota.gpus == 2
        claim = (await client.submit(SubmitRequest(tenant=tenant, resources=GPUMEM)))["claim"]
        node = (await client.wait_for(claim, {"prepared"})).node
        enforcer = cluster.find(f"enforcer-{node}")
        await asyncio.to_thread(cluster.stop_process, enforcer)  # nobody can release it for now

        await admin.delete(path)

        async def pending():
            obj = await admin.get(path)
            return obj if (obj or {}).get("status", {}).get("reason") == "ClaimsNotReleased" else None

        obj = await eventually(pending, what="the object to say its claims are not released")
        assert FINALIZER in obj["metadata"]["finalizers"] and obj["metadata"].get("deletionTimestamp")
        assert obj["status"]["phase"] == "Deleting" and claim in obj["status"]["message"]
        assert (await client.claim(claim)).state == "prepared"
        assert await admin.get(deployment) is not None

        cluster.spawn("enforcer", instance=enforcer.name, env={"TESSERA_NODE": node})
        async def gone() -> bool:
            return await admin.get(path) is None

        await eventually(gone, what="the object gone")
        assert (await client.claim(claim)).state == "released"
        ledger = Ledger(await bus.kv(subjects.KV_LEDGER))
        assert claim not in (await ledger.read_node(node))[0].entries
        assert (await ledger.read_tenant(tenant))[0].claims == {}
        assert await mgr.store.controlplanes.get(tenant) is None and await mgr.store.tenants.get(tenant) is None
        assert await admin.get(deployment) is None
        assert not any(t.done() for t in tasks), [t for t in tasks if t.done()]
    finally:
        await client.close()
        await cancel_and_wait(tasks)
        await mgr.close()
        await forget(admin, path)
        await admin.close()


async def forget(admin: KubeApi, path: str) -> None:
    """A TenantControlPlane a failed test left on the session's plane is gone, finalizer and all (no
    later test's manager serves it)."""
    try:
        await admin.patch(path, {"metadata": {"finalizers": None}})
        await admin.delete(path)
    except NotFound:
        pass
