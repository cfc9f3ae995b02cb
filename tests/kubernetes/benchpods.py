"""Many GPU pods on the real kubelet at once: created → Running, with admission timed on its own
(part of `make bench`: kubebench.py).

Everything is test_real_gpu_pod.py's (`kubetessera.tessera_on_node`): the real control plane, the
real node (kubelet + containerd with CDI), Tessera's services with their deploy/k8s identities and
its webhook as the API server calls it. The pods are written for HAMi (`gpupods.hami_pod`: the probe
holding a slice of one GPU until its stdin closes) and created at once through the API,
`CONCURRENCY` requests in flight, rather than one kubectl process each (on two cores a kubectl
start costs more than the request).

Per pod: *admission* is its create request (the API server's admission chain, the translator's
webhook among it, and the write), *created → Running* from the create's answer until a watch sees
the pod's phase Running (the translator's claim, placement, the gate lifted, kube-scheduler's bind,
the kubelet's NodePrepareResources on the enforcer, containerd's CDI edits, the container started).
Once all are Running they are watched for `hold` seconds more: a container that stops meanwhile is
counted as killed, with what the pod's status, the kubelet's and containerd's logs say about it.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tessera.shared.events import GpuQuota
from tessera.shared.kubeapi import KubeApi, object_path
from tessera.shared.kubeclaims import TENANT_LABEL
from tessera.shared.natsserver import NatsServer

from tessera.cli.client import Client

from kit import eventually
from kit.kubecluster import KubeControlPlane, start_control_plane
from kit.kubecluster import remove as remove_plane
from kit.kubenode import KubeNode, start_node
from kit.kubenode import remove as remove_node
from benchfleet import bounded, percentile
from gpupods import hami_pod
import probeimage
from kubetessera import OnNode, create_tenant, ledgers, node_profile, tessera_on_node
from webhook_tls import SERVING_NAMES, Authority

TENANT = "bench"
MEMORY_MIB, CORES = 256, 2  # per pod: 100 of them fit on 4 GPUs of 32 shares each
GPUS, SHARES = 4, 32
CONCURRENCY = 16
# what the kubelet, containerd and Tessera's services log when they stop a container, or why
KILL_WORDS = re.compile(r"evict|Killing container|OOM|preempt|SyncLoop DELETE|SyncLoop REMOVE|TaskOOM|"
                        r"exit_status:137|released|reclaimed|killed|sent SIG|lost", re.IGNORECASE)


def oom_kills() -> int:
    """The kernel's count of processes its OOM killer killed since boot (any cgroup's or the box's)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def oom_score_adjs(node_name: str) -> list[int]:
    """The ``oom_score_adj`` of the probes running in ``node_name``'s pods (their cgroups are under
    the node's own cgroup root): whom the kernel's OOM killer takes first when the box runs short."""
    scores = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if probeimage.PROBE.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            if f"/{node_name}/" not in Path(f"/proc/{pid}/cgroup").read_text():
                continue
            scores.add(int(Path(f"/proc/{pid}/oom_score_adj").read_text()))
        except (OSError, ValueError):
            continue
    return sorted(scores)


@dataclass
class PodTimes:
    sent: float = 0.0
    created: float = 0.0
    running: float = 0.0
    node: str = ""
    stopped: list[str] = field(default_factory=list)  # what ended a container, each once


@dataclass
class PodsRun:
    minor: str
    pods: int
    figures: dict
    killed: dict[str, list[str]]  # pod -> what ended its container while it should have been running
    log_lines: list[str]  # the kubelet's and containerd's lines about stopping containers, while held


def _terminated(pod: dict) -> list[str]:
    out = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for key in ("state", "lastState"):
            done = (status.get(key) or {}).get("terminated")
            if done:
                out.append(f"{status['name']}: exit {done.get('exitCode')} reason {done.get('reason')} "
                           f"signal {done.get('signal')} at {done.get('finishedAt')}")
    status = pod.get("status") or {}
    if status.get("reason") or status.get("phase") in ("Failed", "Succeeded"):
        out.append(f"pod: phase {status.get('phase')} reason {status.get('reason')} {status.get('message', '')}")
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        out.append(f"pod: deleted at {pod['metadata']['deletionTimestamp']}")
    return out


async def _watch(admin: KubeApi, namespace: str, times: dict[str, PodTimes], holding: asyncio.Event) -> None:
    async for _kind, pod in admin.watch(object_path("v1", "pods", namespace=namespace)):
        name = pod["metadata"]["name"]
        t = times.setdefault(name, PodTimes())
        t.node = (pod.get("spec") or {}).get("nodeName") or t.node
        if not t.running and (pod.get("status") or {}).get("phase") == "Running":
            t.running = time.perf_counter()
        if holding.is_set():
            for why in _terminated(pod):
                if why not in t.stopped:
                    t.stopped.append(why)


async def measure(minor: str, pods: int, *, hold: float = 30.0, timeout: float = 600, progress=print,
                  workdir: Path | None = None) -> PodsRun:
    """``pods`` GPU pods on one real node of a fresh control plane of version ``minor``."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="tessera-benchpods-"))
    plane = await asyncio.to_thread(start_control_plane, minor)
    node = nats = None
    try:
        node = await asyncio.to_thread(start_node, plane)
        nats = NatsServer(workdir / "nats").start()
        namespace = "bench-pods"
        await asyncio.to_thread(plane.kubectl, "create", "namespace", namespace)
        await asyncio.to_thread(plane.wait_for_service_account, namespace, "default")
        return await run_on(plane, node, nats.url, workdir, namespace, pods, hold=hold, timeout=timeout,
                            progress=progress)
    finally:
        if node is not None:
            await asyncio.to_thread(remove_node, node)
        if nats is not None:
            nats.stop()
        await asyncio.to_thread(remove_plane, plane)


async def run_on(plane: KubeControlPlane, node: KubeNode, nats_url: str, workdir: Path, namespace: str, pods: int,
                 *, hold: float, timeout: float, progress=print) -> PodsRun:
    """``pods`` GPU pods in ``namespace`` (which exists) on ``node``, Tessera started here for them."""
    ca = Authority()
    cert, key = ca.issue(workdir / "webhook-tls", list(SERVING_NAMES))
    profile = node_profile(workdir / "fleet.yaml", node.name, gpus=GPUS, max_shares=SHARES)
    async with tessera_on_node(plane, node, nats_url, workdir / "tessera", profile, (ca, cert, key)) as tessera:
        client = await Client.connect(nats_url)
        admin = KubeApi.for_kubeconfig(plane.admin_kubeconfig)
        try:
            return await _run(admin, client, node, tessera, plane.minor, namespace, pods, hold, timeout, progress)
        finally:
            await admin.close()
            await client.close()


async def _run(admin: KubeApi, client: Client, node: KubeNode, tessera: OnNode, minor: str, namespace: str,
               pods: int, hold: float, timeout: float, progress) -> PodsRun:
    times: dict[str, PodTimes] = {}
    holding = asyncio.Event()
    await create_tenant(client, TENANT, GpuQuota())
    await admin.patch(object_path("v1", "namespaces", namespace), {"metadata": {"labels": {TENANT_LABEL: TENANT}}})
    watcher = asyncio.create_task(_watch(admin, namespace, times, holding), name="watch-pods")
    oom_before = oom_kills()
    try:
        names = [f"gpu-{i:03d}" for i in range(pods)]

        async def create(name: str) -> None:
            t = times.setdefault(name, PodTimes())
            t.sent = time.perf_counter()
            await admin.create(object_path("v1", "pods", namespace=namespace),
                               hami_pod(name, namespace, tessera.image, MEMORY_MIB, CORES))
            t.created = time.perf_counter()

        progress(f"{minor}: creating {pods} GPU pods ({CONCURRENCY} requests in flight)")
        await bounded((create(n) for n in names), CONCURRENCY)
        deadline = time.monotonic() + timeout
        while sum(1 for n in names if times[n].running) < pods and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        running = [n for n in names if times[n].running]
        progress(f"{minor}: {len(running)}/{pods} Running; watching them {hold:.0f} s more")
        logs = {"kubelet": lambda: node.log("kubelet"), "containerd": lambda: node.log("containerd")}
        logs.update({sp.name: (lambda path=sp.log_path: path.read_text(errors="replace"))
                     for sp in tessera.cluster.processes})
        marks = {name: len(read()) for name, read in logs.items()}
        holding.set()
        adjs = oom_score_adjs(node.name)
        await asyncio.sleep(hold)
        killed = {n: times[n].stopped for n in names if times[n].stopped}
        if oom_kills() > oom_before:  # the kernel's own account of whom it killed
            dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
            killed_lines = [line for line in dmesg.splitlines() if "Killed process" in line or "oom-kill" in line]
            logs_oom = [f"kernel: {line}" for line in killed_lines[-50:]]
        else:
            logs_oom = []
        lines = [f"{name}: {line}" for name, read in logs.items() for line in read()[marks[name]:].splitlines()
                 if KILL_WORDS.search(line)] + logs_oom

        sent = [times[n].sent for n in names]
        admission = [times[n].created - times[n].sent for n in names]
        to_running = [times[n].running - times[n].created for n in running]
        figures = {
            "pods": pods, "running": len(running), "killed": len(killed),
            "admission_p50_s": percentile(admission, 0.5), "admission_p99_s": percentile(admission, 0.99),
            "created_s": max(times[n].created for n in names) - min(sent),
            "running_p50_s": percentile(to_running, 0.5), "running_p99_s": percentile(to_running, 0.99),
            "all_running_s": (max(times[n].running for n in running) - min(sent)) if running else float("nan"),
            "nodes": sorted({times[n].node for n in running}),
            "oom_kills": oom_kills() - oom_before,  # on the whole box while the pods ran
            "oom_score_adj": adjs,
        }

        # give everything back before the node goes: the kubelet unprepares, the ledger empties
        progress(f"{minor}: deleting the pods")
        await bounded((admin.delete(object_path("v1", "pods", n, namespace=namespace)) for n in names), CONCURRENCY)

        async def given_back() -> bool:
            left, _ = await admin.list(object_path("v1", "pods", namespace=namespace))
            return not left and all(not lg.entries for lg in (await ledgers(client)).values())
        figures["given_back"] = bool(await eventually(given_back, timeout=180, what="the pods gone and the ledger empty"))
        return PodsRun(minor, pods, figures, killed, lines)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
