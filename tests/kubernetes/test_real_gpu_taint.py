"""A failing GPU on the real node: a DRA device taint in its slice, never allocated, untainted when it
recovers (KEP-5055, DRADeviceTaints: beta and on in 1.36, GA in 1.37).

The simulated fleet is the real node with two GPUs; gpu-0 fails by an edit of the profile (what the
capacity publisher reads again at every heartbeat, as it reads NVML on real hardware). Then:
- the node's ResourceSlice keeps gpu-0, tainted ``gpu.tessera.dev/unhealthy:NoSchedule`` (the API
  server stamps ``timeAdded``);
- Tessera's placement puts a new claim on gpu-1, the one left;
- kube-scheduler's own DRA allocator, for a plain ResourceClaim of a class that selects the
  driver's devices, takes gpu-1 as well: it skips a tainted device the claim does not tolerate;
- the GPU recovers: the taint goes, and kube-scheduler's next claim gets gpu-0 again (so the taint
  was what kept it off).
"""

from __future__ import annotations

import asyncio
import json

import yaml

from tessera.shared import subjects
from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import ClaimRecord, ClaimRequested, ClaimSpec, GpuQuota
from tessera.shared.kubeclaims import DRIVER

from tessera.cli.client import Client
from tessera.enforcer.cdi import spec_path
from tessera.translator.service import TranslatorService

from kit import eventually
from kit.kubecluster import apply, manifests, node_bound_identity, service_identity
from kubetessera import KubeletDirs, create_tenant, start_services

GPU = {"model": "NVIDIA H100 80GB HBM3", "memory_mib": 81559}
TENANT = "alpha"
PROBE_CLASS = "taint-probe.tests.tessera.dev"  # kube-scheduler allocates claims of this class itself
IDENTITIES = {"capacity": "capacity.yaml", "placement": "placement.yaml", "enforcer": "enforcer.yaml",
              "controlplane": "controlplane/manager.yaml"}


def _fleet(path, node: str, gpu0_healthy: bool) -> None:
    path.write_text(yaml.safe_dump({"nodes": [{"name": node, "gpus": [{**GPU, "healthy": gpu0_healthy}, GPU]}]}))


async def _request(client: Client, claim: str) -> None:
    """What the translator does for a submitted claim: record it, publish ``requested``."""
    spec = ClaimSpec(gpus=1, memory_mib=1024)
    store = ClaimStore(await client.bus.kv(subjects.KV_CLAIMS))
    revision = await store.create(ClaimRecord(claim=claim, tenant=TENANT, state="requested", spec=spec))
    await client.bus.publish(subjects.claim(TENANT, claim, "requested"),
                             ClaimRequested(claim=claim, tenant=TENANT, spec=spec, record_revision=revision or 0),
                             msg_id=f"{claim}:requested")


async def _release(client: Client, claim: str) -> None:
    """What the translator does for a release (no translator runs here: the test acts as it, as for
    the request): mark the record, then send the translator's own release message for it."""
    record = await ClaimStore(await client.bus.kv(subjects.KV_CLAIMS)).mark_release_requested(claim, "test finished")
    assert record is not None, f"no record of {claim}"
    message = TranslatorService._release_message(record, record.reason)
    assert message is not None, f"{claim} is over already ({record.state})"
    subject, event, msg_id = message
    await client.bus.publish(subject, event, msg_id=msg_id)


async def test_a_failing_gpu_is_tainted_not_allocated_and_untainted_when_it_recovers(
        kube_cluster, kube_node, kube_namespace, nats_url, tmp_path):
    node = kube_node.name

    async def kubectl(*args: str, **kw):
        return await asyncio.to_thread(kube_cluster.kubectl, *args, **kw)

    async def devices() -> dict[str, dict]:
        out = await kubectl("get", "resourceslices", "-o", "json", f"--field-selector=spec.nodeName={node},spec.driver={DRIVER}")
        [one] = json.loads(out.stdout)["items"]
        return {d["name"]: d for d in one["spec"]["devices"]}

    async def scheduler_allocates(name: str) -> str:
        """The device kube-scheduler allocates to a plain claim of the probe class, for a pod on the node."""
        claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": name, "namespace": kube_namespace},
                 "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": PROBE_CLASS}}]}}}
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": kube_namespace},
               "spec": {"nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 0,
                        "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                        "containers": [{"name": "main", "image": kube_node.image("busybox"), "command": ["true"],
                                        "resources": {"claims": [{"name": "gpu"}]}}]}}
        await kubectl("create", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [claim, pod]}))

        async def allocated():
            got = json.loads((await kubectl("get", "-n", kube_namespace, "resourceclaim", name, "-o", "json")).stdout)
            results = ((got.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results")
            return results[0]["device"] if results else None
        try:
            return await eventually(allocated, timeout=60, what=f"kube-scheduler allocating claim {name}")
        finally:  # (the enforcer refuses to prepare it: Tessera did not allocate it; the pod goes)
            await kubectl("delete", "-n", kube_namespace, "pod", name, "--wait=false", check=False)

    fleet = tmp_path / "fleet.yaml"
    _fleet(fleet, node, gpu0_healthy=True)
    apply(kube_cluster, manifests("namespace.yaml") + manifests("deviceclass.yaml") + [
        {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": PROBE_CLASS},
         "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}])
    identities = {name: service_identity(kube_cluster, manifest) for name, manifest in IDENTITIES.items()}
    identities["capacity"] = node_bound_identity(kube_cluster, "capacity.yaml", node)
    dirs = KubeletDirs(registry=kube_node.plugins_registry, plugin=kube_node.plugins_dir / DRIVER,
                       cdi=kube_node.cdi_dir)
    cluster = await start_services(tmp_path / "tessera", nats_url, profile=fleet,
                                   services=("controlplane", "capacity", "placement"), kubeconfigs=identities,
                                   kubelets={node: dirs})
    client = await Client.connect(nats_url)
    try:
        await eventually(devices, timeout=60, what="the node's slice, once its plugin is registered")
        assert not any(d.get("taints") for d in (await devices()).values())
        await create_tenant(client, TENANT, GpuQuota(gpus=2))

        _fleet(fleet, node, gpu0_healthy=False)  # gpu-0 fails
        sick = await eventually(lambda: _tainted(devices, "gpu-0"), timeout=30, what="gpu-0 tainted in the slice")
        assert [(t["key"], t["effect"]) for t in sick["taints"]] == [("gpu.tessera.dev/unhealthy", "NoSchedule")]
        assert sick["taints"][0].get("timeAdded"), sick  # the API server kept the taint (the gate is on)
        assert not (await devices())["gpu-1"].get("taints")

        await _request(client, "taint-probe-1")
        placed = await client.wait_for("taint-probe-1", {"allocated", "prepared"}, timeout=30)
        assert (placed.node, [d.index for d in placed.devices]) == (node, [1]), placed
        assert await scheduler_allocates("probe-sick") == "gpu-1"

        _fleet(fleet, node, gpu0_healthy=True)  # it recovers
        await eventually(lambda: _untainted(devices, "gpu-0"), timeout=30, what="gpu-0's taint gone")
        assert await scheduler_allocates("probe-well") == "gpu-0"
        # give the claim back, so that its CDI spec leaves the session's node with it
        await _release(client, "taint-probe-1")
        await client.wait_for("taint-probe-1", {"released"}, timeout=60)
        # (the enforcer removes the claim's spec and directory at its next pass after the release)
        await eventually(lambda: not spec_path(kube_node.cdi_dir, "taint-probe-1").exists(), timeout=30,
                         what="the claim's CDI spec to go with it")
    finally:
        await client.close()
        await asyncio.to_thread(cluster.stop)
        await kubectl("delete", "deviceclass", PROBE_CLASS, "--ignore-not-found", check=False)


async def _tainted(devices, name: str) -> dict | None:
    device = (await devices())[name]
    return device if device.get("taints") else None


async def _untainted(devices, name: str) -> bool:
    return not (await devices())[name].get("taints")
