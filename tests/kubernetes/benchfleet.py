"""Allocation throughput on simulated nodes: Tessera's placement against kube-scheduler's own DRA
allocator, on the same real control plane, for the same pods (part of `make bench`: kubebench.py).

The fleet is Node objects and ResourceSlices with no kubelet behind them, as kube-scheduler's
``scheduler_perf`` builds its DRA fleets: each node gets a status (allocatable CPU, memory and pods,
Ready) and two slices of the same GPUs, one of Tessera's driver (`tessera.capacity.slices`, what
its publisher writes) and one of a plain driver, ``bench.tessera.dev``, whose devices are ordinary
DRA devices (no consumable capacity) of a DeviceClass of that name, which kube-scheduler allocates.
Each side gets the same number of pods, each asking for one whole GPU and tolerating every taint
(no kubelet keeps these nodes Ready):

- kube-scheduler: a ResourceClaimTemplate of the plain class (``exactly`` one device) in the pods'
  namespace; the resourceclaim controller makes each pod's claim, kube-scheduler allocates it and
  binds the pod;
- Tessera: what its webhook leaves (`gpupods.GpuPods.submit`): the translator's template, the pod
  with the placement gate; the controller makes the claim, the translator publishes it, placement
  allocates against its ledger, writes the allocation and lifts the gate, kube-scheduler binds.

A pod counts when a watch sees it bound (``spec.nodeName``). Figures: pods/s from the first create
to the last bind, and the p50/p99 of each pod's created → bound. Tessera's services run as
processes (`kubetessera.start_services`, no enforcers: nothing runs on these nodes) with their
deploy/k8s identities; its inventory is the same fleet, put in the ``inventory`` bucket as the
capacity publisher would (as the through-NATS benchmark does: no publisher heartbeating thousands
of nodes shares the two cores). kube-scheduler and the controller manager run with their client
QPS raised (`CLIENT_QPS`): at their defaults (scheduler 50, controller manager 20 requests/s) both
sides would measure the rate limiter, not the allocator; scheduler_perf raises them too. The
controller manager runs without its node lifecycle controller (`NO_NODE_LIFECYCLE`).
"""

from __future__ import annotations

import asyncio
import copy
import os
import re
import ssl
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.events import ClaimSpec, NodeInventory, TenantRecord, encode
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import RESOURCE_API_VERSION, TENANT_LABEL
from tessera.shared.natsserver import NatsServer
from tessera.shared.profile import load as load_profile
from tessera.shared.settings import BusSettings

from tessera.capacity.slices import resource_slice

from kit.kubecluster import KubeControlPlane, service_identity, start_control_plane
from kit.kubecluster import remove as remove_plane
from gpupods import GpuPods
from kubetessera import GPU, start_services

BENCH_DRIVER = "bench.tessera.dev"  # the plain DRA driver kube-scheduler allocates from
TENANT = "bench"
GPUS_PER_NODE = 8
CLIENT_QPS = ("--kube-api-qps=5000", "--kube-api-burst=5000")
# No node lifecycle controller: with no kubelet renewing their Leases it would turn thousands of
# nodes NotReady and taint them while the pods are measured, a storm of writes a real fleet's
# healthy nodes never cause (scheduler_perf runs no such controller either).
NO_NODE_LIFECYCLE = ("--controllers=-node-lifecycle-controller",)
# The requests a pod's way costs: what the allocators, the controllers and the benchmark do for it
# (leases, nodes and the like are the control plane's own).
POD_RESOURCES = ("pods", "resourceclaims", "resourceclaimtemplates", "events", "namespaces")
WHOLE_GPU = ClaimSpec(gpus=1, cores=100, memory_percent=100)
CONCURRENCY = 32  # requests in flight while making the fleet and the pods


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def fleet_profile(path: Path, nodes: int) -> Path:
    """``nodes`` simulated nodes of `GPUS_PER_NODE` H100s each, as a profile file."""
    path.write_text(yaml.safe_dump({"groups": [{
        "prefix": "sim", "nodes": nodes, "gpus": GPUS_PER_NODE,
        **{k: GPU[k] for k in ("model", "memory_mib", "sm_count", "architecture", "compute_capability",
                               "driver_version")}}]}))
    return path


def bench_slice(inv: NodeInventory) -> dict:
    """The node's GPUs as plain DRA devices of `BENCH_DRIVER`: the same names and attributes as
    Tessera's slice, without consumable capacity, so each is allocated whole."""
    doc = copy.deepcopy(resource_slice(inv, generation=1))
    doc["metadata"] = {"name": f"{inv.node}-bench"}
    doc["spec"]["driver"] = BENCH_DRIVER
    for device in doc["spec"]["devices"]:
        device.pop("capacity", None)
        device.pop("allowMultipleAllocations", None)
    return doc


def bench_objects() -> list[dict]:
    return [{"apiVersion": RESOURCE_API_VERSION, "kind": "DeviceClass", "metadata": {"name": BENCH_DRIVER},
             "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{BENCH_DRIVER}'"}}]}}]


def plain_pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}],
                     "containers": [{"name": "main", "image": "registry.example/train:1",
                                     "resources": {"claims": [{"name": "gpu"}]}}],
                     "tolerations": [{"operator": "Exists"}]}}


def plain_template() -> dict:
    return {"apiVersion": RESOURCE_API_VERSION, "kind": "ResourceClaimTemplate", "metadata": {"name": "gpu"},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": BENCH_DRIVER}}]}}}}


async def bounded(coros, limit: int = CONCURRENCY) -> list:
    gate = asyncio.Semaphore(limit)

    async def one(coro):
        async with gate:
            return await coro
    return await asyncio.gather(*(one(c) for c in coros))


def rss_mib(pid: int) -> tuple[float, float]:
    """(resident now, peak) of ``pid`` in MiB."""
    now = peak = 0.0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                now = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    except OSError:
        pass
    return now, peak


def mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Side:
    """One allocator's pods: when each was sent, created, got its claim, had it allocated, was bound."""

    name: str
    namespace: str
    sent: dict[str, float] = field(default_factory=dict)
    created: dict[str, float] = field(default_factory=dict)
    claimed: dict[str, float] = field(default_factory=dict)  # pod -> its ResourceClaim seen
    allocated: dict[str, float] = field(default_factory=dict)  # pod -> its claim seen allocated
    bound: dict[str, float] = field(default_factory=dict)
    node: dict[str, str] = field(default_factory=dict)
    requests: dict[str, float] = field(default_factory=dict)  # API requests while this side ran

    def _stage(self, start: dict[str, float], end: dict[str, float]) -> float:
        return percentile([end[p] - start[p] for p in end if p in start], 0.50)

    def figures(self) -> dict:
        pods = len(self.created)
        latencies = [self.bound[p] - self.created[p] for p in self.bound if p in self.created]
        first = min(self.sent.values(), default=0.0)
        return {
            "allocator": self.name, "pods": pods, "bound": len(self.bound),
            "pods_per_s": len(self.bound) / (max(self.bound.values()) - first) if self.bound else 0.0,
            "created_per_s": pods / (max(self.created.values()) - first) if self.created else 0.0,
            "p50_s": percentile(latencies, 0.50), "p99_s": percentile(latencies, 0.99),
            # where a pod's time goes (p50 of each step): the controller making its claim, the
            # allocator allocating it, kube-scheduler binding the pod
            "to_claim_p50_s": self._stage(self.created, self.claimed),
            "to_allocated_p50_s": self._stage(self.claimed, self.allocated),
            "to_bound_p50_s": self._stage(self.allocated, self.bound),
            "requests_per_pod": {k: v / pods for k, v in self.requests.items()} if pods else {},
        }


async def _watch_bound(admin: KubeApi, side: Side) -> None:
    async for _kind, pod in admin.watch(object_path("v1", "pods", namespace=side.namespace)):
        name, node = pod["metadata"]["name"], (pod.get("spec") or {}).get("nodeName")
        if node and name not in side.bound:
            side.bound[name] = time.perf_counter()
            side.node[name] = node


async def _watch_claims(admin: KubeApi, side: Side) -> None:
    async for _kind, claim in admin.watch(object_path(RESOURCE_API_VERSION, "resourceclaims",
                                                      namespace=side.namespace)):
        owners = [o["name"] for o in claim["metadata"].get("ownerReferences") or [] if o.get("kind") == "Pod"]
        for pod in owners:
            side.claimed.setdefault(pod, time.perf_counter())
            if (claim.get("status") or {}).get("allocation"):
                side.allocated.setdefault(pod, time.perf_counter())


def request_counts(plane: KubeControlPlane) -> dict[str, float]:
    """The API server's requests so far on `POD_RESOURCES` (``apiserver_request_total``, watches
    left out): all, the writes among them, and each "VERB resource[/subresource]"."""
    ctx = ssl.create_default_context(cafile=str(plane.pki.ca_file))
    ctx.load_cert_chain(str(plane.pki.dir / "admin.crt"), str(plane.pki.dir / "admin.key"))
    with urllib.request.urlopen(f"{plane.url}/metrics", context=ctx, timeout=30) as answer:
        text = answer.read().decode()
    counts = {"all": 0.0, "writes": 0.0}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        verb, resource = re.search(r'verb="([A-Z]+)"', line), re.search(r'resource="([^"]*)"', line)
        if verb is None or verb[1] in ("WATCH", "CONNECT") or resource is None or resource[1] not in POD_RESOURCES:
            continue
        value = float(line.rsplit(" ", 1)[1])
        counts["all"] += value
        if verb[1] in ("POST", "PUT", "PATCH", "DELETE", "APPLY"):
            counts["writes"] += value
        sub = re.search(r'subresource="([^"]*)"', line)
        key = f"{verb[1]} {resource[1]}{'/' + sub[1] if sub and sub[1] else ''}"
        counts[key] = counts.get(key, 0.0) + value
    return counts


async def _run_side(plane: KubeControlPlane, admin: KubeApi, side: Side, create, pods: int, timeout: float) -> dict:
    """Create ``pods`` pods with ``create(name)``, all at once (`CONCURRENCY` in flight), and wait
    until the watch has seen each bound."""
    watchers = [asyncio.create_task(_watch_bound(admin, side), name=f"watch-pods-{side.name}"),
                asyncio.create_task(_watch_claims(admin, side), name=f"watch-claims-{side.name}")]
    before = await asyncio.to_thread(request_counts, plane)
    try:
        async def one(name: str) -> None:
            side.sent[name] = time.perf_counter()
            await create(name)
            side.created[name] = time.perf_counter()
        await bounded(one(f"p{i:05d}") for i in range(pods))
        deadline = time.monotonic() + timeout
        while len(side.bound) < pods and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        after = await asyncio.to_thread(request_counts, plane)
        side.requests = {k: after[k] - before.get(k, 0.0) for k in after if after[k] > before.get(k, 0.0)}
    finally:
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    return side.figures()


async def _allocations(admin: KubeApi, namespace: str) -> list[tuple[str, str, str]]:
    """(driver, pool, device) of every allocated claim's one result in ``namespace``."""
    claims, _ = await admin.list(object_path(RESOURCE_API_VERSION, "resourceclaims", namespace=namespace))
    return [(r["driver"], r["pool"], r["device"]) for c in claims
            for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []]


async def make_fleet(admin: KubeApi, fleet: list[NodeInventory]) -> None:
    """The Node objects (with a status a kubelet would post) and both drivers' slices."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    resources = {"cpu": "64", "memory": "256Gi", "pods": "110"}

    async def node(inv: NodeInventory) -> None:
        made = await admin.create(object_path("v1", "nodes"), {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": inv.node, "labels": {"kubernetes.io/hostname": inv.node}}})
        await admin.patch_status(object_path("v1", "nodes", inv.node), {"status": {
            "capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated",
                            "lastHeartbeatTime": now, "lastTransitionTime": now}]}})
        slices = object_path(RESOURCE_API_VERSION, "resourceslices")
        await admin.create(slices, resource_slice(inv, generation=1, node_uid=made["metadata"]["uid"]))
        await admin.create(slices, bench_slice(inv))
    await bounded(node(inv) for inv in fleet)


@dataclass
class FleetRun:
    """One fleet size's figures: each allocator's, the set-up's, and memory."""

    nodes: int
    sides: list[dict]
    setup_s: float
    rss_mib: dict[str, tuple[float, float]]
    mem_available_min_mib: float
    distinct_devices: dict[str, int]  # allocator -> distinct (driver, pool, device) its pods' claims got
    drivers: dict[str, set[str]]  # allocator -> the drivers of those devices


async def measure(nodes: int, pods: int, *, minor: str = "v1.36", order: tuple[str, ...] = ("scheduler", "tessera"),
                  timeout: float = 600, progress=print, workdir: Path | None = None,
                  service_env: dict[str, str] | None = None) -> FleetRun:
    """Both allocators on one fresh control plane with ``nodes`` simulated nodes, ``pods`` pods
    each, in ``order`` (``service_env``: more settings for Tessera's services)."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="tessera-benchfleet-"))
    lowest = [mem_available_mib()]
    plane: KubeControlPlane = await asyncio.to_thread(
        start_control_plane, minor,
        component_flags={"kube-scheduler": CLIENT_QPS, "kube-controller-manager": CLIENT_QPS + NO_NODE_LIFECYCLE})
    nats = NatsServer(workdir / "nats").start()
    admin = KubeApi.for_kubeconfig(plane.admin_kubeconfig)
    gpu_pods = cluster = bus = None
    try:
        fleet = load_profile(fleet_profile(workdir / "fleet.yaml", nodes))
        begin = time.perf_counter()
        gpu_pods = GpuPods(plane)  # (Tessera's DeviceClass and admission policies, the translator's identity)
        await admin.create(object_path(RESOURCE_API_VERSION, "deviceclasses"), bench_objects()[0])
        progress(f"{nodes} nodes: making the fleet ({nodes} Nodes, {2 * nodes} ResourceSlices)")
        await make_fleet(admin, fleet)
        bus = await Bus.connect(BusSettings(url=nats.url), "bench")
        await bus.ensure_topology()
        inventory = await bus.kv(subjects.KV_INVENTORY)
        await bounded(inventory.put(inv.node, encode(inv)) for inv in fleet)
        await (await bus.kv(subjects.KV_TENANTS)).put(TENANT, encode(TenantRecord(tenant=TENANT)))
        identities = {name: await asyncio.to_thread(service_identity, plane, f"{name}.yaml")
                      for name in ("translator", "placement")}
        cluster = await start_services(workdir / "tessera", nats.url, profile=workdir / "fleet.yaml",
                                       services=("translator", "placement"), kubeconfigs=identities,
                                       enforcers=False, env={"TESSERA_LOG_LEVEL": "WARNING", **(service_env or {})})
        setup = time.perf_counter() - begin
        lowest.append(mem_available_mib())
        sides = []
        for name in order:
            namespace = f"bench-{name}"
            await admin.create(object_path("v1", "namespaces"), {
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": namespace, "labels": {TENANT_LABEL: TENANT} if name == "tessera" else {}}})
            await asyncio.to_thread(plane.wait_for_service_account, namespace, "default")
            side = Side(name, namespace)
            if name == "scheduler":
                await admin.create(object_path(RESOURCE_API_VERSION, "resourceclaimtemplates", namespace=namespace),
                                   plain_template())

                async def create(pod: str, namespace=namespace) -> None:
                    await admin.create(object_path("v1", "pods", namespace=namespace), plain_pod(pod))
            else:
                async def create(pod: str, namespace=namespace) -> None:
                    await gpu_pods.submit(namespace, pod, WHOLE_GPU, tolerate_all=True)
            progress(f"{nodes} nodes: {pods} pods allocated by {name}")
            figures = await _run_side(plane, admin, side, create, pods, timeout)
            lowest.append(mem_available_mib())
            progress(f"{nodes} nodes, {name}: {figures['bound']}/{pods} bound, {figures['pods_per_s']:.1f} pods/s, "
                     f"p50 {figures['p50_s']:.2f} s, p99 {figures['p99_s']:.2f} s")
            sides.append(figures)
        distinct, drivers = {}, {}
        for name in order:
            allocated = await _allocations(admin, f"bench-{name}")
            distinct[name] = len(set(allocated))
            drivers[name] = {driver for driver, _pool, _device in allocated}
        rss = {proc: rss_mib(p.pid) for proc, p in plane.procs.items()}
        rss.update({sp.name: rss_mib(sp.proc.pid) for sp in cluster.processes})
        return FleetRun(nodes, sides, setup, rss, min(lowest), distinct, drivers)
    finally:
        if bus is not None:
            await bus.close()
        if gpu_pods is not None:
            await gpu_pods.close()
        await admin.close()
        if cluster is not None:
            await asyncio.to_thread(cluster.stop)
        nats.stop()
        await asyncio.to_thread(remove_plane, plane)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))
