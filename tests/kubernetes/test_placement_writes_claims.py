"""Placement on Kubernetes: the real placement processes allocate in the ledger and write the
ResourceClaim's ``status.allocation``, lift the pod's gate, report on the pod — and give the
allocation back when the cluster cannot be told.

The services (capacity publisher, placement, control-plane manager, an enforcer per node) run as
processes against a real nats-server and the API-server emulator, which validates every write
strictly. The test plays the translator's claim watcher (it publishes ``requested`` for the
ResourceClaim, as the translator does), the resourceclaim controller, kube-scheduler and the
kubelet (`kubeparts`); the end-to-end suite runs the real translator and its webhook too.
"""

from __future__ import annotations

import asyncio

import pytest

from tessera.shared.events import ClaimSpec, GpuQuota
from tessera.shared.kubeclaims import DRIVER, SCHEDULING_GATE, TENANT_LABEL, claim_id
from tessera.shared.ledger import device_totals

from tessera.cli.client import Client
from tessera.placement.claimstatus import allocation, same_allocation
from tessera.translator.dra import resource_claim_template

from kube_objects import namespace
from kubeparts import Refused, add_node, claims_of, kubelet_start, make_claims, schedule
from kit import eventually
from kubetessera import create_tenant, ledgers, quota_in_use, request_claim, start_services

RC = "resource.k8s.io/v1"
CARD_MIB = 81559  # tests/profiles/tiny.yaml: 2 nodes x 2 H100 80GB
OTHER_GATE = "example.com/admission-check"


@pytest.fixture
async def world(apiserver, nats_url, tmp_path):
    """Nodes and a tenant's namespace in the cluster, the services running, a client on the bus."""
    for name in ("gpu-0", "gpu-1"):
        await add_node(apiserver, name)
    await apiserver.create(namespace("team-a", {TENANT_LABEL: "alpha"}))
    started, clusters = [], []

    async def start(**kwargs):
        cluster = await start_services(tmp_path / f"tessera{len(started)}", nats_url, apiserver.url, **kwargs)
        started.append(cluster)
        clusters.append(cluster)
        client = await Client.connect(nats_url)
        started.append(client)
        return client

    start.clusters = clusters
    yield start
    for thing in reversed(started):
        if isinstance(thing, Client):
            await thing.close()
        else:
            await asyncio.to_thread(thing.stop)


async def gated_pod(apiserver, name: str, spec: ClaimSpec, *, other_gate: bool = False) -> dict:
    """A pod as the webhook leaves it (template in its namespace, claim reference, our gate) and
    its ResourceClaim as the resourceclaim controller makes it; returns (pod, claim)."""
    template = resource_claim_template(spec, f"{name}-gpu", "team-a")
    await apiserver.create(template)
    gates = [{"name": SCHEDULING_GATE}] + ([{"name": OTHER_GATE}] if other_gate else [])
    pod = await apiserver.create({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "team-a"},
        "spec": {"schedulingGates": gates,
                 "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": f"{name}-gpu"}],
                 "containers": [{"name": "main", "image": "registry.example/train:1",
                                 "resources": {"claims": [{"name": "gpu"}]}}]},
    })
    [claim] = await make_claims(apiserver, pod)
    return apiserver.object("v1", "pods", name, "team-a"), claim


def current(apiserver, obj: dict) -> dict | None:
    meta = obj["metadata"]
    api_version, plural = (RC, "resourceclaims") if obj["kind"] == "ResourceClaim" else ("v1", "pods")
    return apiserver.object(api_version, plural, meta["name"], meta["namespace"])


def allocation_of(apiserver, claim: dict) -> dict | None:
    return ((current(apiserver, claim) or {}).get("status") or {}).get("allocation")


def events_on(apiserver, pod: dict, reason: str | None = None) -> list[dict]:
    return [e for e in apiserver.objects("v1", "events", "team-a")
            if e["involvedObject"].get("uid") == pod["metadata"]["uid"] and (reason is None or e["reason"] == reason)]


def placed_condition(apiserver, pod: dict) -> dict | None:
    conditions = (current(apiserver, pod).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == "gpu.tessera.dev/Placed"), None)


def gates(apiserver, pod: dict) -> list[str]:
    return [g["name"] for g in current(apiserver, pod)["spec"].get("schedulingGates") or []]


async def test_the_allocation_is_written_only_our_gate_is_lifted_and_the_pod_binds_there(world, apiserver):
    client = await world()
    await create_tenant(client, "alpha", GpuQuota(gpus=4))
    spec = ClaimSpec(gpus=2, memory_mib=20000, cores=30)
    pod, claim = await gated_pod(apiserver, "train", spec, other_gate=True)
    conflicts = apiserver.fail("PUT", r"/resourceclaims/[^/]+/status$", 409, times=2)  # as if written meanwhile
    cid = await request_claim(client, "alpha", claim, pod, spec)

    assert await eventually(lambda: allocation_of(apiserver, claim)), "placement wrote no allocation"
    assert conflicts.hits == 2  # each 409 was re-read and retried
    record = await client.wait_for(cid, {"allocated", "prepared", "running"})
    entry = (await ledgers(client))[record.node].entries[cid]
    written = allocation_of(apiserver, claim)
    assert same_allocation(written, allocation(cid, record.node, entry.shares))  # the ledger's, exactly
    assert {r["driver"] for r in written["devices"]["results"]} == {DRIVER}
    assert [r["consumedCapacity"]["memory"] for r in written["devices"]["results"]] == ["20000Mi", "20000Mi"]

    assert await eventually(lambda: gates(apiserver, pod) == [OTHER_GATE]), gates(apiserver, pod)
    with pytest.raises(Refused, match="gated"):  # another component's gate is not ours to lift
        await schedule(apiserver, pod)
    await apiserver.patch("v1", "pods", "train", {"spec": {"schedulingGates": None}}, "team-a")
    assert await schedule(apiserver, pod) == record.node
    running = await kubelet_start(apiserver, pod)
    assert running["spec"]["nodeName"] == record.node and running["status"]["phase"] == "Running"
    assert (await eventually(lambda: events_on(apiserver, pod, "Allocated")))[0]["type"] == "Normal"
    assert (await eventually(lambda: placed_condition(apiserver, pod)))["status"] == "True"
    [reserved] = claims_of(apiserver, current(apiserver, pod))
    assert reserved["status"]["reservedFor"][0]["uid"] == pod["metadata"]["uid"]


async def test_quota_exceeded_is_reported_on_the_pod_the_gate_stays_nothing_is_allocated(world, apiserver):
    client = await world()
    await create_tenant(client, "alpha", GpuQuota(gpus=1))
    spec = ClaimSpec(gpus=1, memory_mib=10000, cores=10)
    first, first_claim = await gated_pod(apiserver, "first", spec)
    await request_claim(client, "alpha", first_claim, first, spec)
    assert await eventually(lambda: allocation_of(apiserver, first_claim))

    pod, claim = await gated_pod(apiserver, "second", ClaimSpec(gpus=1, memory_mib=10000, cores=10))
    cid = await request_claim(client, "alpha", claim, pod, spec)
    record = await client.wait_for(cid, {"unschedulable"})
    assert "quota" in record.reason

    [event] = await eventually(lambda: events_on(apiserver, pod, "Unschedulable"))
    assert event["type"] == "Warning" and record.reason in event["message"]
    condition = await eventually(lambda: placed_condition(apiserver, pod))
    assert condition["status"] == "False" and condition["reason"] == "Unschedulable"
    assert record.reason in condition["message"]
    assert gates(apiserver, pod) == [SCHEDULING_GATE] and allocation_of(apiserver, claim) is None
    with pytest.raises(Refused, match="gated"):
        await schedule(apiserver, pod)
    assert cid not in {c for lg in (await ledgers(client)).values() for c in lg.entries}
    assert set((await quota_in_use(client, "alpha")).claims) == {claim_id(first_claim["metadata"]["uid"])}


async def test_two_placement_replicas_racing_never_overcommit_and_every_status_matches_the_ledger(world, apiserver):
    client = await world(placement_replicas=2)
    await create_tenant(client, "alpha", GpuQuota())
    spec = ClaimSpec(gpus=1, memory_mib=30000, cores=30)  # two fit on a card by memory: 8 of these fit
    pods = [await gated_pod(apiserver, f"race-{i}", spec) for i in range(10)]
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
        written = await eventually(lambda claim=claim: allocation_of(apiserver, claim))
        assert same_allocation(written, allocation(record.claim, record.node, nodes[record.node].entries[record.claim].shares))
        for result in written["devices"]["results"]:
            key = (result["pool"], result["device"])
            consumed[key] = consumed.get(key, 0) + int(result["consumedCapacity"]["memory"].removesuffix("Mi"))
        assert await eventually(lambda pod=pod: SCHEDULING_GATE not in gates(apiserver, pod))
    assert max(consumed.values()) <= CARD_MIB and len(consumed) == 4
    for record, (pod, claim) in zip(records, pods):
        if record.state == "unschedulable":
            assert allocation_of(apiserver, claim) is None and gates(apiserver, pod) == [SCHEDULING_GATE]
            assert await eventually(lambda pod=pod: events_on(apiserver, pod, "Unschedulable"))


async def test_an_unreachable_api_server_is_waited_for_then_the_allocation_is_given_back(world, apiserver):
    client = await world(env={"TESSERA_PLACEMENT_KUBE_RETRY_SECONDS": "6", "TESSERA_PLACEMENT_KUBE_TIMEOUT_SECONDS": "2"})
    await create_tenant(client, "alpha", GpuQuota(gpus=4))
    spec = ClaimSpec(gpus=1, memory_mib=10000, cores=10)

    # Down for a moment: the status write is retried and lands when the API server is back.
    pod, claim = await gated_pod(apiserver, "patient", spec)
    await apiserver.stop()
    cid = await request_claim(client, "alpha", claim, pod, spec)
    await client.wait_for(cid, {"allocated", "prepared"})
    await asyncio.sleep(1.0)
    await apiserver.start()
    assert await eventually(lambda: allocation_of(apiserver, claim)), "the write was not retried"
    assert await eventually(lambda: SCHEDULING_GATE not in gates(apiserver, pod))

    # Down past the retry budget: the allocation is released, ledger and quota are as before.
    pod2, claim2 = await gated_pod(apiserver, "given-back", spec)
    await apiserver.stop()
    cid2 = await request_claim(client, "alpha", claim2, pod2, spec)
    released = await client.wait_for(cid2, {"released"}, timeout=60)
    assert "kubernetes" in released.reason
    await apiserver.start()
    # The ledger entry goes last, a moment after the record says released (it marks an unfinished release).
    assert await eventually(lambda: _off_every_ledger(client, cid2)), f"{cid2} is still in a ledger"
    assert set((await quota_in_use(client, "alpha")).claims) == {cid}
    assert allocation_of(apiserver, claim2) is None and gates(apiserver, pod2) == [SCHEDULING_GATE]

    # Refused for good (the status write answered 422): given back at once, said on the pod.
    apiserver.fail("PUT", r"/resourceclaims/[^/]+/status$", 422, times=None)
    pod3, claim3 = await gated_pod(apiserver, "refused", spec)
    cid3 = await request_claim(client, "alpha", claim3, pod3, spec)
    released = await client.wait_for(cid3, {"released"}, timeout=30)
    [event] = await eventually(lambda: events_on(apiserver, pod3, "AllocationFailed"))
    assert event["type"] == "Warning" and "422" in event["message"]
    assert set((await quota_in_use(client, "alpha")).claims) == {cid}
    assert gates(apiserver, pod3) == [SCHEDULING_GATE]


async def test_a_status_write_a_killed_replica_left_undone_is_done_by_the_next_one(world, apiserver):
    client = await world()
    await create_tenant(client, "alpha", GpuQuota(gpus=4))
    cluster = world.clusters[-1]
    spec = ClaimSpec(gpus=1, memory_mib=10000, cores=10)
    pod, claim = await gated_pod(apiserver, "orphan", spec)
    await apiserver.stop()  # the write cannot happen now...
    cid = await request_claim(client, "alpha", claim, pod, spec)
    await client.wait_for(cid, {"allocated", "prepared"})
    placement = cluster.find("placement")
    placement.proc.kill()  # ...and the replica that owed it is gone, SIGKILL, queue and all
    await asyncio.to_thread(placement.proc.wait)
    await apiserver.start()
    cluster.spawn("placement", instance="placement-again")
    assert await eventually(lambda: allocation_of(apiserver, claim)), "the restarted placement did not write it"
    record = await client.claim(cid)
    assert record.state in ("allocated", "prepared") and cid in (await ledgers(client))[record.node].entries
    assert await eventually(lambda: SCHEDULING_GATE not in gates(apiserver, pod))


async def _off_every_ledger(client, cid: str) -> bool:
    return cid not in {c for lg in (await ledgers(client)).values() for c in lg.entries}
