"""Placement on Kubernetes: the real placement processes allocate in the ledger and write the
ResourceClaim's ``status.allocation``, lift the pod's gate, report on the pod — and give the
allocation back when the cluster cannot be told.

The services (capacity publisher, placement, control-plane manager, an enforcer per node) run as
processes against a real nats-server and the real control plane (tests/kit/kubecluster.py), each as
the ServiceAccount of its deploy/k8s manifest with that manifest's RBAC. Real: kube-apiserver, the
resourceclaim controller (it makes each pod's claim from the translator's template), kube-scheduler
(it binds the pod once the gates are gone, reserving the claim). The test plays the translator's
claim watcher (it publishes ``requested`` for the ResourceClaim, as the translator does); the nodes
are Node objects without kubelets (`realfaults.ready_node`), so a bound pod never runs. Faults are
the real server's: a 409 from a write made meanwhile (`ConflictingWrites`), an API server stopped
and started (on the session's spare control plane), a write refused by an admission policy (422).
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import yaml

from tessera.shared import quantity
from tessera.shared.events import ClaimSpec, GpuQuota
from tessera.shared.kubeapi import object_path
from tessera.shared.kubeclaims import DRIVER, RESOURCE_API_VERSION, SCHEDULING_GATE, TENANT_LABEL, claim_id
from tessera.shared.ledger import device_totals

from tessera.cli.client import Client
from tessera.placement.claimstatus import allocation, same_allocation

from gpupods import GpuPods
from kit import eventually
from kit.kubecluster import KubeControlPlane, service_identity
from kubetessera import PROFILES, create_tenant, ledgers, quota_in_use, request_claim, start_services
from realfaults import ConflictingWrites, ready_node, refuse_writes

CARD_MIB = 81559  # tests/profiles/tiny.yaml: 2 nodes x 2 H100 80GB
OTHER_GATE = "example.com/admission-check"
IDENTITIES = {"capacity": "capacity.yaml", "placement": "placement.yaml", "enforcer": "enforcer.yaml",
              "controlplane": "controlplane/manager.yaml"}


class World:
    """A tenant's namespace, two Ready nodes of this test's own (tiny.yaml's, renamed), Tessera's
    services as their deploy/k8s identities (``start``), and the objects they work on."""

    def __init__(self, plane: KubeControlPlane, namespace: str, nats_url: str, workdir: Path) -> None:
        self.plane, self.ns, self.nats_url, self.workdir = plane, namespace, nats_url, workdir
        self.started: list = []
        self.clusters: list = []

    async def __aenter__(self) -> "World":
        self.pods = await asyncio.to_thread(GpuPods, self.plane)
        self.admin = self.pods.admin
        self.identities = {name: await asyncio.to_thread(service_identity, self.plane, manifest)
                           for name, manifest in IDENTITIES.items()}
        await asyncio.to_thread(self.plane.kubectl, "label", "namespace", self.ns, f"{TENANT_LABEL}=alpha")
        fleet = yaml.safe_load((PROFILES / "tiny.yaml").read_text())
        prefix = f"gpu-{uuid.uuid4().hex[:6]}"
        fleet["groups"][0]["prefix"] = prefix
        self.profile = self.workdir / "fleet.yaml"
        self.profile.write_text(yaml.safe_dump(fleet))
        self.nodes = [f"{prefix}-{i}" for i in range(fleet["groups"][0]["nodes"])]
        for node in self.nodes:
            await ready_node(self.admin, node)
        return self

    async def start(self, **kwargs) -> Client:
        cluster = await start_services(self.workdir / f"tessera{len(self.clusters)}", self.nats_url,
                                       profile=self.profile, kubeconfigs=self.identities, **kwargs)
        self.started.append(cluster)
        self.clusters.append(cluster)
        client = await Client.connect(self.nats_url)
        self.started.append(client)
        return client

    async def __aexit__(self, *exc) -> None:
        for thing in reversed(self.started):
            if isinstance(thing, Client):
                await thing.close()
            else:
                await asyncio.to_thread(thing.stop)
        for node in self.nodes:
            await asyncio.to_thread(self.plane.kubectl, "delete", "node", node, "--ignore-not-found", "--wait=false")
        await self.pods.close()

    async def gated_pod(self, name: str, spec: ClaimSpec, *, other_gate: bool = False,
                        timeout: float = 30) -> tuple[dict, dict]:
        """A pod as the webhook leaves it (the translator's template, our gate) and the claim the
        resourceclaim controller made for it."""
        return await self.pods.create(self.ns, name, spec, gates=(OTHER_GATE,) if other_gate else (),
                                      tolerate_all=True, timeout=timeout)

    async def current(self, obj: dict) -> dict | None:
        meta = obj["metadata"]
        api_version, plural = (RESOURCE_API_VERSION, "resourceclaims") if obj["kind"] == "ResourceClaim" \
            else ("v1", "pods")
        return await self.admin.get(object_path(api_version, plural, meta["name"], meta["namespace"]))

    async def allocation_of(self, claim: dict) -> dict | None:
        return ((await self.current(claim) or {}).get("status") or {}).get("allocation")

    async def events_on(self, pod: dict, reason: str | None = None) -> list[dict]:
        items, _ = await self.admin.list(object_path("v1", "events", namespace=self.ns))
        return [e for e in items if e["involvedObject"].get("uid") == pod["metadata"]["uid"]
                and (reason is None or e["reason"] == reason)]

    async def condition(self, pod: dict, kind: str) -> dict | None:
        conditions = ((await self.current(pod)).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == kind), None)

    async def placed_condition(self, pod: dict) -> dict | None:
        return await self.condition(pod, "gpu.tessera.dev/Placed")

    async def gates(self, pod: dict) -> list[str]:
        return [g["name"] for g in (await self.current(pod))["spec"].get("schedulingGates") or []]

    async def held_by_its_gates(self, pod: dict) -> bool:
        """kube-scheduler's verdict on a gated pod: not scheduled, because of its gates."""
        scheduled = await self.condition(pod, "PodScheduled")
        return bool(scheduled and scheduled["status"] == "False" and scheduled["reason"] == "SchedulingGated"
                    and not (await self.current(pod))["spec"].get("nodeName"))


@pytest.fixture
async def world(kube_plane, plane_namespace, nats_url, tmp_path):
    async with World(kube_plane, plane_namespace, nats_url, tmp_path) as made:
        yield made


@pytest.fixture
async def own_world(breakable_plane, nats_url, tmp_path):
    """A world on the session's spare control plane, whose API server the test stops and starts."""
    ns = f"t-{uuid.uuid4().hex[:10]}"
    await asyncio.to_thread(breakable_plane.kubectl, "create", "namespace", ns)
    await asyncio.to_thread(breakable_plane.wait_for_service_account, ns, "default")
    async with World(breakable_plane, ns, nats_url, tmp_path) as made:
        yield made


async def test_the_allocation_is_written_only_our_gate_is_lifted_and_the_pod_binds_there(world, tmp_path):
    client = await world.start()
    await create_tenant(client, "alpha", GpuQuota(gpus=4))
    spec = ClaimSpec(gpus=2, memory_mib=20000, cores=30)
    pod, claim = await world.gated_pod("train", spec, other_gate=True)
    probe = ["patch", "resourceclaim", "-n", world.ns, claim["metadata"]["name"], "--subresource=status",
             "--type=merge", "-p", '{"metadata": {"labels": {"probe": "1"}}}']
    async with ConflictingWrites(world.plane, world.admin, world.ns, "resource.k8s.io", "resourceclaims", "status",
                                 times=2, workdir=tmp_path, probe=probe) as conflicts:  # written meanwhile, twice
        cid = await request_claim(client, "alpha", claim, pod, spec)
        assert await eventually(lambda: world.allocation_of(claim), timeout=30), "placement wrote no allocation"
    assert conflicts.conflicts == 2  # each 409 was re-read and retried
    refused = [e for e in world.plane.audit() if e["objectRef"].get("name") == claim["metadata"]["name"]
               and e["objectRef"].get("subresource") == "status" and e["responseStatus"]["code"] == 409
               and e["user"]["username"].endswith(":tessera-placement")]
    assert len(refused) == 2, refused
    record = await client.wait_for(cid, {"allocated", "prepared", "running"})
    entry = (await ledgers(client))[record.node].entries[cid]
    written = await world.allocation_of(claim)
    assert same_allocation(written, allocation(cid, record.node, entry.shares))  # the ledger's, exactly
    assert {r["driver"] for r in written["devices"]["results"]} == {DRIVER}
    assert [quantity.whole_mib(r["consumedCapacity"]["memory"]) for r in written["devices"]["results"]] \
        == [20000, 20000]

    assert await eventually(lambda: _equal(world.gates(pod), [OTHER_GATE]), timeout=30), await world.gates(pod)
    # another component's gate is not ours to lift: kube-scheduler leaves the pod alone
    assert await eventually(lambda: world.held_by_its_gates(pod), timeout=30)
    await world.admin.patch(object_path("v1", "pods", "train", world.ns), {"spec": {"schedulingGates": None}})
    bound = await eventually(lambda: _bound(world, pod), timeout=60, what="the pod bound by kube-scheduler")
    assert bound == record.node
    assert (await eventually(lambda: world.events_on(pod, "Allocated")))[0]["type"] == "Normal"
    assert (await eventually(lambda: world.placed_condition(pod)))["status"] == "True"
    reserved = await world.current(claim)
    assert reserved["status"]["reservedFor"][0]["uid"] == pod["metadata"]["uid"]


async def test_quota_exceeded_is_reported_on_the_pod_the_gate_stays_nothing_is_allocated(world):
    client = await world.start()
    await create_tenant(client, "alpha", GpuQuota(gpus=1))
    spec = ClaimSpec(gpus=1, memory_mib=10000, cores=10)
    first, first_claim = await world.gated_pod("first", spec)
    await request_claim(client, "alpha", first_claim, first, spec)
    assert await eventually(lambda: world.allocation_of(first_claim), timeout=30)

    pod, claim = await world.gated_pod("second", ClaimSpec(gpus=1, memory_mib=10000, cores=10))
    cid = await request_claim(client, "alpha", claim, pod, spec)
    record = await client.wait_for(cid, {"unschedulable"})
    assert "quota" in record.reason

    [event] = await eventually(lambda: world.events_on(pod, "Unschedulable"), timeout=30)
    assert event["type"] == "Warning" and record.reason in event["message"]
    condition = await eventually(lambda: world.placed_condition(pod), timeout=30)
    assert condition["status"] == "False" and condition["reason"] == "Unschedulable"
    assert record.reason in condition["message"]
    assert await world.gates(pod) == [SCHEDULING_GATE] and await world.allocation_of(claim) is None
    assert await eventually(lambda: world.held_by_its_gates(pod), timeout=30)
    assert cid not in {c for lg in (await ledgers(client)).values() for c in lg.entries}
    assert set((await quota_in_use(client, "alpha")).claims) == {claim_id(first_claim["metadata"]["uid"])}


async def test_two_placement_replicas_racing_never_overcommit_and_every_status_matches_the_ledger(world):
    client = await world.start(placement_replicas=2)
    await create_tenant(client, "alpha", GpuQuota())
    spec = ClaimSpec(gpus=1, memory_mib=30000, cores=30)  # two fit on a card by memory: 8 of these fit
    pods = [await world.gated_pod(f"race-{i}", spec) for i in range(10)]
    ids = await asyncio.gather(*(request_claim(client, "alpha", claim, pod, spec) for pod, claim in pods))

    records = [await client.wait_for(cid, {"allocated", "prepared", "running", "unschedulable"}) for cid in ids]
    allocated = [(r, p) for r, p in zip(records, pods) if r.state != "unschedulable"]
    assert len(allocated) == 8, [r.state for r in records]

    nodes = await ledgers(client)
    for node_ledger in nodes.values():
        for totals in device_totals(node_ledger).values():
            assert totals.memory_mib <= CARD_MIB and totals.cores <= 100
    consumed: dict[tuple[str, str], int] = {}
    for record, (pod, claim) in allocated:
        written = await eventually(lambda claim=claim: world.allocation_of(claim), timeout=30)
        assert same_allocation(written, allocation(record.claim, record.node,
                                                   nodes[record.node].entries[record.claim].shares))
        for result in written["devices"]["results"]:
            key = (result["pool"], result["device"])
            consumed[key] = consumed.get(key, 0) + quantity.whole_mib(result["consumedCapacity"]["memory"])
        assert await eventually(lambda pod=pod: _lacks(world.gates(pod), SCHEDULING_GATE), timeout=30)
    assert max(consumed.values()) <= CARD_MIB and len(consumed) == 4
    for record, (pod, claim) in zip(records, pods):
        if record.state == "unschedulable":
            assert await world.allocation_of(claim) is None and await world.gates(pod) == [SCHEDULING_GATE]
            assert await eventually(lambda pod=pod: world.events_on(pod, "Unschedulable"), timeout=30)


async def test_an_unreachable_api_server_is_waited_for_then_the_allocation_is_given_back(own_world):
    world = own_world
    plane = world.plane
    # (a retry budget longer than a real API server's restart: 5-6 s here, more on a loaded machine)
    client = await world.start(env={"TESSERA_PLACEMENT_KUBE_RETRY_SECONDS": "25",
                                    "TESSERA_PLACEMENT_KUBE_TIMEOUT_SECONDS": "2"})
    await create_tenant(client, "alpha", GpuQuota(gpus=4))
    spec = ClaimSpec(gpus=1, memory_mib=10000, cores=10)

    # Down for a moment: the status write is retried and lands when the API server is back.
    pod, claim = await world.gated_pod("patient", spec)
    await asyncio.to_thread(plane.stop_apiserver)
    cid = await request_claim(client, "alpha", claim, pod, spec)
    await client.wait_for(cid, {"allocated", "prepared"})
    await asyncio.sleep(1.0)
    await asyncio.to_thread(plane.start_apiserver)
    assert await eventually(lambda: world.allocation_of(claim), timeout=30), "the write was not retried"
    assert await eventually(lambda: _lacks(world.gates(pod), SCHEDULING_GATE), timeout=30)

    # Down past the retry budget: the allocation is released, ledger and quota are as before.
    # (the controllers' informers back off after the first outage too: see the third pod below)
    pod2, claim2 = await world.gated_pod("given-back", spec, timeout=90)
    await asyncio.to_thread(plane.stop_apiserver)
    cid2 = await request_claim(client, "alpha", claim2, pod2, spec)
    released = await client.wait_for(cid2, {"released"}, timeout=60)
    assert "kubernetes" in released.reason
    await asyncio.to_thread(plane.start_apiserver)
    # The ledger entry goes last, a moment after the record says released (it marks an unfinished release).
    assert await eventually(lambda: _off_every_ledger(client, cid2)), f"{cid2} is still in a ledger"
    assert set((await quota_in_use(client, "alpha")).claims) == {cid}
    assert await world.allocation_of(claim2) is None and await world.gates(pod2) == [SCHEDULING_GATE]

    # Refused for good (a policy of the cluster's refuses the status write, 422): given back at
    # once, said on the pod.
    # (after the API server was away for the retry budget, the controllers' informers back off up
    # to 30 s before they list again: the claim may come that much later)
    pod3, claim3 = await world.gated_pod("refused", spec, timeout=90)
    await refuse_writes(plane, world.ns, "resource.k8s.io", "resourceclaims/status", probe=[
        "patch", "resourceclaim", "-n", world.ns, claim3["metadata"]["name"], "--subresource=status",
        "--type=merge", "-p", '{"metadata": {"labels": {"probe": "1"}}}'])
    cid3 = await request_claim(client, "alpha", claim3, pod3, spec)
    await client.wait_for(cid3, {"released"}, timeout=30)
    [event] = await eventually(lambda: world.events_on(pod3, "AllocationFailed"), timeout=30)
    assert event["type"] == "Warning" and "422" in event["message"]
    assert set((await quota_in_use(client, "alpha")).claims) == {cid}
    assert await world.gates(pod3) == [SCHEDULING_GATE]


async def test_a_status_write_a_killed_replica_left_undone_is_done_by_the_next_one(own_world):
    world = own_world
    plane = world.plane
    client = await world.start()
    await create_tenant(client, "alpha", GpuQuota(gpus=4))
    cluster = world.clusters[-1]
    spec = ClaimSpec(gpus=1, memory_mib=10000, cores=10)
    pod, claim = await world.gated_pod("orphan", spec)
    await asyncio.to_thread(plane.stop_apiserver)  # the write cannot happen now...
    cid = await request_claim(client, "alpha", claim, pod, spec)
    await client.wait_for(cid, {"allocated", "prepared"})
    placement = cluster.find("placement")
    placement.proc.kill()  # ...and the replica that owed it is gone, SIGKILL, queue and all
    await asyncio.to_thread(placement.proc.wait)
    await asyncio.to_thread(plane.start_apiserver)
    cluster.spawn("placement", instance="placement-again", env={"KUBECONFIG": str(world.identities["placement"])})
    assert await eventually(lambda: world.allocation_of(claim), timeout=30), "the restarted placement did not write it"
    record = await client.claim(cid)
    assert record.state in ("allocated", "prepared") and cid in (await ledgers(client))[record.node].entries
    assert await eventually(lambda: _lacks(world.gates(pod), SCHEDULING_GATE), timeout=30)


async def _bound(world: World, pod: dict) -> str | None:
    return (await world.current(pod))["spec"].get("nodeName")


async def _equal(value, expected) -> bool:
    return await value == expected


async def _lacks(value, item) -> bool:
    return item not in await value


async def _off_every_ledger(client, cid: str) -> bool:
    return cid not in {c for lg in (await ledgers(client)).values() for c in lg.entries}
