"""Translator and placement in this process on the real control plane, and the nodes they place on.

Real: kube-apiserver, kube-scheduler, the resourceclaim and node lifecycle controllers (the
`kube_cluster` fixture); the translator and placement services run here as the runner runs them, as
their service accounts of deploy/k8s, on a real nats-server. Played: the capacity publisher (each
node's GPU inventory written into the bucket; ResourceSlices only where a test asks, since
kube-scheduler can allocate a claim itself from them) and the nodes, Node objects without a kubelet. Used by the tests of placement's part
in scheduling (node constraints, allocations another allocator wrote).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt

import pytest

from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import GpuDevice, NodeInventory, TenantRecord, encode
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, TENANT_LABEL
from tessera.shared.runner import serve
from tessera.shared.settings import BusSettings, ServiceSettings

from tessera.capacity.slices import resource_slice
from tessera.placement.service import PlacementService, PlacementSettings
from tessera.translator.service import TranslatorService, TranslatorSettings

from gpupods import GpuPods
from kit import eventually
from kit.kubecluster import delete_driver_slices, service_identity

MODEL = "NVIDIA H100 80GB HBM3"
ZONE = "tessera.test/zone"
# No kubelet keeps these nodes Ready: the node lifecycle controller taints them not-ready, then
# unreachable. The pods tolerate that (and only that), as a DaemonSet's pods do.
NOT_READY = [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"},
             {"key": "node.kubernetes.io/unreachable", "operator": "Exists"}]


@contextlib.asynccontextmanager
async def in_process(nats_url: str, name: str, make):
    """A service (``make(ctx)``) run as its runner runs it, until the block ends; yields it ready."""
    made = []

    async def build(ctx):
        service = make(ctx)
        made.append(service)
        return await service.start()

    stop = asyncio.Event()
    task = asyncio.create_task(serve(ServiceSettings(service=name, bus=BusSettings(url=nats_url)), build, stop=stop))
    try:
        async with asyncio.timeout(60):
            while not (made and made[0].ctx.ready):
                if task.done():
                    task.result()
                    raise AssertionError(f"{name} ended before it was ready")
                await asyncio.sleep(0.05)
        yield made[0]
    finally:
        stop.set()
        await task


class World:
    def __init__(self, plane, namespace: str, bus: Bus, pods: GpuPods) -> None:
        self.plane = plane
        self.ns = namespace
        self.bus = bus
        self.pods = pods
        self.nodes: list[str] = []

    def name(self, what: str) -> str:
        return f"{self.ns}-{what}"

    async def node(self, what: str, *, zone: str = "a", cpu: str = "8", unschedulable: bool = False,
                   taints: tuple[dict, ...] = (), slices: bool = False) -> str:
        """A Node object as its kubelet would report it, and its GPU inventory in the bucket
        (``slices``: and its ResourceSlice, as the capacity publisher writes it, from which
        kube-scheduler can then allocate a claim itself)."""
        name = self.name(what)
        admin = self.pods.admin
        made = await admin.create(object_path("v1", "nodes"), {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, ZONE: zone}},
            "spec": {"unschedulable": unschedulable, "taints": list(taints)}})
        self.nodes.append(name)
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        room = {"cpu": cpu, "memory": "32Gi", "pods": "110"}
        await admin.patch_status(object_path("v1", "nodes", name), {"status": {
            "allocatable": room, "capacity": room,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now,
                            "lastTransitionTime": now}]}})
        inventory = NodeInventory(node=name, devices=[GpuDevice(uuid=f"GPU-{name}-0", index=0, model=MODEL,
                                                                 memory_mib=81559)])
        await (await self.bus.kv(subjects.KV_INVENTORY)).put(name, encode(inventory))
        if slices:
            await admin.create(object_path(RESOURCE_API_VERSION, "resourceslices"),
                               resource_slice(inventory, 1, made["metadata"]["uid"]))
        return name

    @contextlib.asynccontextmanager
    async def tessera(self, nats_url: str, **placement_settings):
        """The translator (its claim watcher) and placement, in Kubernetes mode, as deployed
        (``placement_settings``: other PlacementSettings, a shorter reconcile period, say)."""
        translator_api = KubeApi.for_kubeconfig(service_identity(self.plane, "translator.yaml"))
        placement_api = KubeApi.for_kubeconfig(service_identity(self.plane, "placement.yaml"))
        settings = PlacementSettings(kubernetes=True, kube_retry_seconds=60, **placement_settings)
        async with in_process(nats_url, "placement", lambda ctx: PlacementService(ctx, settings, placement_api)) \
                as placement, \
                in_process(nats_url, "translator", lambda ctx: TranslatorService(
                    ctx, TranslatorSettings(kubernetes=True, reconcile_seconds=30), translator_api)):
            yield placement

    async def held_pod(self, name: str, spec) -> tuple[dict, str]:
        """A GPU pod that another gate of its own holds once Tessera lifts its gate: (its claim,
        the node of its first allocation)."""
        _, claim = await self.pods.create(self.ns, name, spec, gates=("example.com/hold",),
                                          pod_spec={"tolerations": NOT_READY})
        placed = await eventually(lambda: self.allocated_node(claim), timeout=60, what="the first allocation")
        return claim, placed

    async def cordon_and_let_go(self, node: str, pod: str) -> None:
        """Cordon ``node`` and lift the held pod's own gate: kube-scheduler cannot bind the pod
        where its claim is allocated, and its PostFilter takes the allocation back."""
        self.plane.kubectl("cordon", node)
        await self.pods.admin.patch(object_path("v1", "pods", pod, self.ns), {"spec": {"schedulingGates": None}})

    async def allocation(self, claim: dict) -> dict | None:
        meta = claim["metadata"]
        current = await self.pods.admin.get(object_path(RESOURCE_API_VERSION, "resourceclaims", meta["name"], meta["namespace"]))
        return ((current or {}).get("status") or {}).get("allocation")

    async def allocated_node(self, claim: dict) -> str | None:
        alloc = await self.allocation(claim)
        if not alloc:
            return None
        [term] = alloc["nodeSelector"]["nodeSelectorTerms"]
        [field] = term["matchFields"]
        return field["values"][0]

    async def bound_to(self, pod: str) -> str | None:
        return ((await self.pods.admin.get(object_path("v1", "pods", pod, self.ns))) or {}).get("spec", {}).get("nodeName")

    async def record(self, cid: str):
        record, _ = await ClaimStore(await self.bus.kv(subjects.KV_CLAIMS)).get(cid)
        return record

    async def events(self, pod: str) -> list[dict]:
        items, _ = await self.pods.admin.list(object_path("v1", "events", namespace=self.ns))
        return [e for e in items if e["involvedObject"].get("name") == pod]


@pytest.fixture
async def world(kube_cluster, kube_namespace, nats_url):
    # The test's tenant is named after its namespace: the claims of earlier tests' namespaces (the
    # control plane is the session's, their deletion takes a while) belong to no tenant here, and
    # so take none of this test's GPUs.
    kube_cluster.kubectl("label", "namespace", kube_namespace, f"{TENANT_LABEL}={kube_namespace}")
    # Nor may an earlier test's slices (the session's real node's): kube-scheduler, taking this
    # test's allocation back, would allocate the claim there itself.
    delete_driver_slices(kube_cluster)
    pods = GpuPods(kube_cluster)
    bus = await Bus.connect(BusSettings(url=nats_url), "test")
    await bus.ensure_topology()
    await (await bus.kv(subjects.KV_TENANTS)).put(kube_namespace, encode(TenantRecord(tenant=kube_namespace)))
    world = World(kube_cluster, kube_namespace, bus, pods)
    try:
        yield world
    finally:
        for name in world.nodes:
            kube_cluster.kubectl("delete", "node", name, "--wait=false", check=False)
        await bus.close()
        await pods.close()
