"""A claim of several requests (a pod's GPU containers) is placed on one node, all of it or none.

Before, each GPU container of a pod was a claim of its own, placed independently: two of them could
be allocated on two nodes, and a pod cannot run on two nodes (issue 22, defect 5). Now the pod is
one claim with one request per container; placement places every request on one node, under
quota, and writes the claim into that node's ledger with one compare-and-set, so no crash or lost
race can leave half of it allocated.
"""

from __future__ import annotations

from fleetkit import inventory
from kit import eventually
from placementkit import replicas, requested, tenant

from tessera.placement.claimstatus import allocation, share_id
from tessera.placement.podreport import pod_claims
from tessera.placement.engine import Placement, Rejection
from tessera.shared.events import DeviceShare, GpuQuota, RequestSpec

TWO = [RequestSpec(name="train", memory_mib=50000, cores=30), RequestSpec(name="eval", memory_mib=20000, cores=20)]


def test_both_requests_land_on_one_node_each_with_its_own_share(harness):
    for policy in ("binpack", "spread", "best-fit", "fragmentation-aware", "random", "fgd-paper"):
        h = harness(inventory("a", gpus=2), inventory("b", gpus=2), default_node_policy=policy)
        r = h.claim(memory_mib=50000, cores=30, requests=TWO)
        assert {s.uuid.rsplit("-", 1)[0] for s in r.shares} == {f"GPU-{r.node}"}, policy
        assert [(s.request, s.memory_mib, s.cores) for s in r.shares] == [("train", 50000, 30), ("eval", 20000, 20)]


def test_two_requests_may_share_a_gpu_as_two_containers_may(harness):
    h = harness(inventory("a", gpus=1), default_node_policy="binpack")
    r = h.claim(memory_mib=50000, cores=30, requests=TWO)
    assert [s.uuid for s in r.shares] == ["GPU-a-0", "GPU-a-0"]
    assert h.fleet.nodes["a"].devices[0].mem_used == 70000


def test_requests_that_fit_only_on_different_nodes_are_placed_nowhere(harness):
    # a has room for "train" only, b for "eval" only: placed independently they would split the pod
    h = harness(inventory("a", gpus=1, memory_mib=60000), inventory("b", gpus=1, memory_mib=30000))
    r = h.place(memory_mib=50000, cores=30, requests=TWO)
    assert isinstance(r, Rejection)
    assert "no node has room for all 2 requests ('train', 'eval') at once" in r.reason
    assert r.filtered == {"together": 2}
    assert all(d.mem_used == 0 for n in h.fleet.nodes.values() for d in n.devices)


def test_a_request_that_fits_nowhere_is_named(harness):
    h = harness(inventory("a", gpus=2))
    too_big = [TWO[0], RequestSpec(name="eval", gpus=3)]
    r = h.place(memory_mib=50000, cores=30, requests=too_big)
    assert isinstance(r, Rejection)
    assert r.reason.startswith("request 'eval': ") and "fewer than 3 GPUs" in r.reason


def test_a_pinned_claim_of_several_requests_stays_on_its_node(harness):
    h = harness(inventory("a", gpus=2), inventory("b", gpus=2))
    r = h.place(memory_mib=50000, cores=30, requests=TWO, node="b")
    assert isinstance(r, Placement) and r.node == "b"


async def test_the_claim_is_one_ledger_entry_on_one_node(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a")
        await eventually(lambda: "a" in svc.tenants_known)
        small = [RequestSpec(name="train", memory_mib=3000), RequestSpec(name="eval", memory_mib=1000, cores=20)]
        event = await requested(svc.bus, "c", memory_mib=3000, cores=0, requests=small)
        assert await svc.place(event)
        record = (await svc.claims.get("c"))[0]
        assert record.state == "allocated"
        held = {node: (await svc.ledger.read_node(node))[0].entries.get("c") for node in ("n1", "n2")}
        assert [n for n, e in held.items() if e is not None] == [record.node]
        entry = held[record.node]
        assert entry is not None and entry.shares == record.devices
        assert [(s.request, s.memory_mib, s.cores) for s in entry.shares] == [("train", 3000, 0), ("eval", 1000, 20)]


async def test_quota_takes_the_whole_claim_or_nothing(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a", GpuQuota(memory_mib=3500))  # room for "train" (3000), not with "eval"
        await eventually(lambda: "a" in svc.tenants_known and "a" in svc.quotas)
        small = [RequestSpec(name="train", memory_mib=3000), RequestSpec(name="eval", memory_mib=1000)]
        event = await requested(svc.bus, "c", memory_mib=3000, cores=0, requests=small)
        assert not await svc.place(event)
        record = (await svc.claims.get("c"))[0]
        assert record.state == "unschedulable" and "quota" in record.reason
        for node in ("n1", "n2"):
            assert (await svc.ledger.read_node(node))[0].entries == {}
        assert (await svc.ledger.read_tenant("a"))[0].claims == {}


def test_the_claims_status_has_a_result_per_request_with_its_own_share():
    shares = [DeviceShare(uuid="GPU-n1-0", index=0, memory_mib=3000, cores=0, request="train"),
              DeviceShare(uuid="GPU-n1-0", index=0, memory_mib=1000, cores=20, request="eval")]
    results = allocation("k8s-c", "n1", shares)["devices"]["results"]
    assert [(r["request"], r["device"], r["consumedCapacity"]["memory"]) for r in results] == [
        ("train", "gpu-0", "3000Mi"), ("eval", "gpu-0", "1000Mi")]
    assert len({r["shareID"] for r in results}) == 2  # one device, two shares
    # a claim of one request keeps the share id it always had
    (one,) = allocation("k8s-c", "n1", [DeviceShare(uuid="GPU-n1-0", index=0, memory_mib=3000, cores=0)])[
        "devices"]["results"]
    assert one["request"] == "gpu" and one["shareID"] == share_id("k8s-c", "n1", 0)


def test_the_gate_waits_for_every_claim_of_the_pod():
    pod = {"spec": {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "tessera-a-b-1"},
                                       {"name": "nic", "resourceClaimName": "shared-nic"},
                                       {"name": "late", "resourceClaimTemplateName": "tessera-c-2"}]},
           "status": {"resourceClaimStatuses": [{"name": "gpus", "resourceClaimName": "trainer-gpus-x7k2p"}]}}
    assert pod_claims(pod) == [("claim", "trainer-gpus-x7k2p"), ("claim", "shared-nic"), ("template", "tessera-c-2")]
