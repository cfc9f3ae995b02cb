"""`tessera bench tenant-pods` (in `make bench`): GPU pods applied to tenants' own API servers, run
on the shared fleet, and bench/tenant_pods.md from the run.

Everything is what runs: a fresh real host control plane (v1.36) and real node (kubelet +
containerd with CDI, simulated GPUs), Tessera's services on it as test_real_gpu_pod.py starts them
(`kubetessera.tessera_on_node`), and the control-plane manager in Kubernetes mode
(`controlplane.planes.kube_manager`: the tenants' control planes its own processes, each Ready
tenant's pod syncer its own task with the tenant's host identity). ``--tenants`` tenants are made
through the manager, each a Tessera tenant too; then ``--pods`` GPU pods written for HAMi, spread
round-robin over the tenants, are created at once through the tenants' own API servers
(`benchfleet.CONCURRENCY` requests in flight in all).

Per pod: *→ Running on the host*: from the create's answer in the tenant's API server until a
watch on the host sees its host pod Running; *→ Running in the tenant's API server*: until a watch
on the tenant's API server sees the tenant's pod Running (the status the syncer copied back).
*Host requests per tenant pod*: what the syncers' host identities asked of the host's API server,
from its audit log, by verb and resource, over the pods (watches counted once each, whatever they
delivered); and, as the placement bench counts them, the host API server's
``apiserver_request_total`` on pods, claims, claim templates, events and namespaces (watches left
out) over the run, every client's, the services' and kubelet's included.

Usage: ``python tests/kubernetes/tenantbench.py [--tenants 10] [--pods 100] [--out bench/tenant_pods.md]
[--label TEXT]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # tests/ (the kit) and this folder, as pytest's rootdir puts them

from tessera.cli.client import Client  # noqa: E402
from tessera.controlplane import manifests as tenant_manifests  # noqa: E402
from tessera.controlplane.datastores.natskv import UsersFile  # noqa: E402
from tessera.controlplane.tenantpods import hostpod  # noqa: E402
from tessera.controlplane.tenantpods.running import ACCOUNT  # noqa: E402
from tessera.shared import identities  # noqa: E402
from tessera.shared.events import GpuQuota  # noqa: E402
from tessera.shared.kubeapi import KubeApi, NotFound, Unavailable  # noqa: E402
from tessera.shared.natsserver import NatsServer  # noqa: E402

import benchfleet  # noqa: E402
from benchfleet import bounded, percentile, request_counts  # noqa: E402
from controlplane.planes import cross_kubeconfig, kube_manager, plane_binaries  # noqa: E402
from gpupods import hami_pod  # noqa: E402
from kit import eventually  # noqa: E402
from kit.kubecluster import apply, kube_version, manifests, start_control_plane  # noqa: E402
from kit.kubecluster import remove as remove_plane  # noqa: E402
from kit.kubenode import start_node  # noqa: E402
from kit.kubenode import remove as remove_node  # noqa: E402
from kubebench import f, machine  # noqa: E402
from kubetessera import create_tenant, ledgers, node_profile, tessera_on_node  # noqa: E402
from webhook_tls import SERVING_NAMES, Authority  # noqa: E402

ROOT = HERE.parents[1]
MINOR = "v1.36"
MEMORY_MIB, CORES = 256, 2
GPUS, SHARES = 4, 32
QUOTA = GpuQuota(gpus=GPUS * SHARES, memory_mib=GPUS * 81559, cores=100 * GPUS * SHARES)
PLATFORM = ("platform", "platform-secret")  # the manager's NATS user (as tests/controlplane's secured_nats)


def _secured_nats(directory: Path) -> tuple[NatsServer, Path, Path]:
    """The manager's nats-server: operator-only config with a users file the manager writes tenants into."""
    directory.mkdir(parents=True)
    users = directory / "users.conf"
    UsersFile(users, None).write({})
    conf = directory / "nats.conf"
    conf.write_text(identities.operator_only_config(*PLATFORM, "users.conf", pid_file=str(directory / "nats.pid")))
    return NatsServer(directory / "store", config_file=conf).start(), users, directory / "nats.pid"


async def _watch_running(api: KubeApi, path: str, seen: dict[str, float], key, deleting: dict | None = None,
                         **selectors) -> None:
    """When each pod was first seen Running (and, into ``deleting``, first seen being deleted)."""
    async for _, pod in api.watch(path, **selectors):
        if (pod.get("status") or {}).get("phase") == "Running":
            seen.setdefault(key(pod), time.perf_counter())
        if deleting is not None and pod["metadata"].get("deletionTimestamp"):
            deleting.setdefault(key(pod), time.perf_counter())


async def measure(tenants: int, pods: int, workdir: Path, progress=print) -> dict:
    plane = await asyncio.to_thread(start_control_plane, MINOR)
    node = nats = secured = None
    try:
        node = await asyncio.to_thread(start_node, plane)
        nats = NatsServer(workdir / "nats").start()
        secured = _secured_nats(workdir / "secured-nats")
        await asyncio.to_thread(apply, plane, manifests("controlplane/tenant-pods.yaml"))
        ca = Authority()
        cert, key = ca.issue(workdir / "webhook-tls", list(SERVING_NAMES))
        profile = node_profile(workdir / "fleet.yaml", node.name, gpus=GPUS, max_shares=SHARES)
        # the etcd driver only: no PostgreSQL is asked for (its settings are never read)
        unused_postgres = SimpleNamespace(admin_url="postgresql://unused@127.0.0.1:1/unused", host="127.0.0.1:1")
        (workdir / "manager").mkdir()
        async with tessera_on_node(plane, node, nats.url, workdir / "tessera", profile, (ca, cert, key)) as tessera:
            client = await Client.connect(nats.url)
            manager = kube_manager("etcd", plane, secured, plane_binaries(), unused_postgres, workdir / "manager")
            try:
                planes = await anext(manager)
                return await _run(plane, node, planes, client, tessera, tenants, pods, workdir, progress)
            finally:
                await manager.aclose()  # (its tenants' control planes stop with it)
                await client.close()
    finally:
        if node is not None:
            await asyncio.to_thread(remove_node, node)
        for server in (nats, secured[0] if secured else None):
            if server is not None:
                server.stop()
        await asyncio.to_thread(remove_plane, plane)


async def _run(plane, node, planes, client, tessera, tenants: int, pods: int, workdir: Path, progress) -> dict:
    names = [f"t{i:02d}" for i in range(tenants)]
    started = time.perf_counter()
    audit_before = len(plane.audit())  # (the syncers' own requests from their first list on)

    async def make(name: str) -> KubeApi:
        record = await planes.create(name)
        await create_tenant(client, name, QUOTA)

        async def syncing():
            now = await planes.record(name)
            return now is not None and now.status.gpu_pods == "Syncing"
        await eventually(syncing, timeout=300, what=f"{name}'s syncer Syncing")
        pki = await planes.pki(name)
        conf = cross_kubeconfig(workdir / f"{name}.kubeconfig", planes.host.endpoint(record), pki["ca.crt"], pki)
        api = KubeApi.for_kubeconfig(str(conf))
        await eventually(lambda: api.get("/api/v1/namespaces/default/serviceaccounts/default"), timeout=120,
                         what=f"{name}'s default service account")
        return api
    apis = dict(zip(names, [await make(name) for name in names]))  # (one at a time: each start is heavy)
    progress(f"{tenants} tenants Ready and syncing in {time.perf_counter() - started:.0f} s")

    admin = KubeApi.for_kubeconfig(plane.admin_kubeconfig)
    created: dict[tuple[str, str], float] = {}
    on_host: dict[tuple[str, str], float] = {}
    in_tenant: dict[tuple[str, str], float] = {}
    terminating: dict[tuple[str, str], float] = {}  # first seen deleting (before the bench deletes: unasked)

    def host_key(pod: dict) -> tuple[str, str]:
        notes = pod["metadata"].get("annotations") or {}
        return pod["metadata"]["labels"][hostpod.TENANT], notes.get(hostpod.NAME, "")
    watchers = [asyncio.create_task(_watch_running(admin, "/api/v1/pods", on_host, host_key,
                                                   label_selector=hostpod.TENANT))]
    watchers += [asyncio.create_task(_watch_running(api, "/api/v1/namespaces/default/pods", in_tenant,
                                                    lambda pod, name=name: (name, pod["metadata"]["name"]),
                                                    terminating))
                 for name, api in apis.items()]
    before = await asyncio.to_thread(request_counts, plane)
    wanted = [(names[i % tenants], f"p{i:03d}") for i in range(pods)]
    try:
        refused: Counter[str] = Counter()

        async def create(tenant: str, name: str) -> None:
            pod = hami_pod(name, "default", tessera.image, MEMORY_MIB, CORES)
            pod["spec"]["securityContext"] = {"runAsUser": 65532}
            while True:  # a tenant's API server on the shared etcd answers 500 now and then under this load
                try:
                    await apis[tenant].create("/api/v1/namespaces/default/pods", pod)
                    break
                except Unavailable as exc:
                    refused[str(exc)[:120]] += 1
                    await asyncio.sleep(0.5)
            created[(tenant, name)] = time.perf_counter()
        first = time.perf_counter()
        await bounded([create(t, n) for t, n in wanted])
        progress(f"{pods} pods created in {time.perf_counter() - first:.1f} s; creates answered 500 and sent "
                 f"again: {dict(refused) or 'none'}")

        async def all_running():
            return len(in_tenant) >= pods and len(on_host) >= pods
        try:
            await eventually(all_running, timeout=1200, what="every tenant pod Running, on the host and in its API")
        except AssertionError:
            progress(f"not all Running: {len(on_host)} on the host, {len(in_tenant)} in the tenants' API servers")
        all_running_s = time.perf_counter() - first
        after = await asyncio.to_thread(request_counts, plane)

        host = [on_host[k] - created[k] for k in created if k in on_host]
        progress(f"{len(host)} Running on the host: p50 {percentile(host, 0.5):.2f} s, p99 {percentile(host, 0.99):.2f} s")

        async def delete(tenant: str, name: str) -> bool:
            try:
                await apis[tenant].call("DELETE", f"/api/v1/namespaces/default/pods/{name}")
            except NotFound:
                pass
            except Unavailable as exc:  # a tenant's API server under this load answers so for a moment
                progress(f"deleting {tenant}/{name}: {exc}; again")
                return False
            return True
        unasked = sorted(f"{t}/{n}" for t, n in terminating)  # (nothing was deleted by the bench yet)
        if unasked:
            progress(f"tenant pods Terminating unasked: {unasked}")
        for tenant, name in wanted:  # given back
            await eventually(lambda tenant=tenant, name=name: delete(tenant, name), timeout=120,
                             what=f"{tenant}/{name} deleted")

        async def given_back():
            return all(not lg.entries for lg in (await ledgers(client)).values())
        back = True
        try:
            await eventually(given_back, timeout=600, what="every pod's claim given back")
        except AssertionError:
            back = False
        # the syncers' own requests, each pod's life whole (its create to its host pod's deletion)
        syncers = {f"system:serviceaccount:{tenant_manifests.namespace(n)}:{ACCOUNT}" for n in names}
        asked = Counter(f"{e['verb']} {e['objectRef'].get('resource', '')}"
                        f"{'/' + e['objectRef']['subresource'] if e['objectRef'].get('subresource') else ''}"
                        for e in plane.audit()[audit_before:]
                        if e["user"]["username"] in syncers and e.get("stage") == "ResponseComplete")
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await admin.close()
        for api in apis.values():
            await api.close()
    host = [on_host[k] - created[k] for k in created if k in on_host]
    tenant = [in_tenant[k] - created[k] for k in created if k in in_tenant]
    return {"version": kube_version(MINOR), "tenants": tenants, "pods": pods,
            "running_on_host": len(host), "running_in_tenant": len(tenant),
            "host_p50_s": percentile(host, 0.5), "host_p99_s": percentile(host, 0.99),
            "tenant_p50_s": percentile(tenant, 0.5), "tenant_p99_s": percentile(tenant, 0.99),
            "all_running_s": all_running_s, "given_back": back, "terminating_unasked": unasked,
            "syncer_requests": {k: v / pods for k, v in sorted(asked.items())},
            "syncer_requests_per_pod": sum(asked.values()) / pods,
            "host_requests_per_pod": (after["all"] - before["all"]) / pods,
            "host_writes_per_pod": (after["writes"] - before["writes"]) / pods}


def page(x: dict, label: str, command: str, before: list[str], after: list[str]) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    lines = [
        "# GPU pods applied to tenants' own API servers, run on the shared fleet", "",
        f"Commit `{commit}`{f' ({label})' if label else ''}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        f"`make bench` (`tessera bench tenant-pods`) regenerates this page; this run: `{command}`.", "",
        f"- Machine before: {before[0]}.", f"- {before[1]}.", f"- Machine after: {after[0]}.", "",
        f"{x['pods']} pods written for HAMi (`nvidia.com/gpu: 1`, `gpumem: {MEMORY_MIB}`, `gpucores: {CORES}`), "
        f"spread round-robin over {x['tenants']} tenants, created at once through the tenants' own API servers "
        f"({benchfleet.CONCURRENCY} requests in flight in all); one real host node ({x['version']}, kubelet + "
        f"containerd with CDI, {GPUS} simulated H100s of {SHARES} shares); each tenant's control plane and pod "
        "syncer run by the control-plane manager, as deployed. *→ host Running*: the create's answer in the "
        "tenant's API server until a host watch sees the host pod Running. *→ tenant Running*: until a watch on "
        "the tenant's API server sees its pod Running (the status copied back). *Host API requests per pod, all "
        "clients*: the host API server's `apiserver_request_total` on pods, claims, claim templates, events and "
        "namespaces (watches left out), from the first create until all were Running, over the pods.", "",
        "| version | tenants | pods | Running on host | Running in tenant API | → host Running p50 / p99 (s) | "
        "→ tenant Running p50 / p99 (s) | all Running (s) | given back | syncers' host requests per pod | "
        "host API requests (writes) per pod, all clients |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {x['version']} | {x['tenants']} | {x['pods']} | {x['running_on_host']} | {x['running_in_tenant']} | "
        f"{f(x['host_p50_s'])} / {f(x['host_p99_s'])} | {f(x['tenant_p50_s'])} / {f(x['tenant_p99_s'])} | "
        f"{f(x['all_running_s'], 1)} | {'yes' if x['given_back'] else 'no'} | {f(x['syncer_requests_per_pod'])} | "
        f"{f(x['host_requests_per_pod'])} ({f(x['host_writes_per_pod'])}) |", "",
        f"Tenant pods that went Terminating before the run deleted them: "
        f"{', '.join(x['terminating_unasked']) or 'none'}.", "",
        "The syncers' host requests per tenant pod, by verb and resource, from the first list of each syncer to "
        "the last pod's deletion (the host's audit log, each tenant's host identity; a watch is one request "
        "however long it runs, and each tenant's list and watch of pods and events are shared by its pods):", "",
        "| request | per pod |", "|---|---|",
        *[f"| {k} | {v:.2f} |" for k, v in x["syncer_requests"].items()], ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--out", default=str(ROOT / "bench" / "tenant_pods.md"))
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    before = machine()
    workdir = Path(tempfile.mkdtemp(prefix="tessera-tenantbench-"))
    figures = asyncio.run(measure(args.tenants, args.pods, workdir, progress=lambda s: print(s, flush=True)))
    command = " ".join(["python", "tests/kubernetes/tenantbench.py", *sys.argv[1:]])
    Path(args.out).write_text(page(figures, args.label, command, before, machine()))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
