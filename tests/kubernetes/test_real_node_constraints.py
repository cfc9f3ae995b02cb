"""A GPU pod is placed where kube-scheduler can bind it, and placed again when the scheduler takes
its allocation back: on the real control plane.

Defect 4 of the review: placement ignored what kube-scheduler's filters check — a cordoned node,
taints the pod does not tolerate, its nodeSelector and required node affinity, the node's room for
its CPU, memory and pods. It wrote an allocation pinned to such a node and lifted the gate; the
scheduler could not bind the pod, its PostFilter took the allocation back, the translator released
the claim ("delete and recreate the pod"), and the pod waited forever. Now the translator sends the
pod's constraints with the claim, placement watches the Nodes and pods and rules out what the
filters refuse (saying which filter refused how many nodes when none is left), and a claim the
scheduler takes back all the same is placed again.

Real here: kube-apiserver, kube-scheduler (its filters, its PostFilter's deallocation, its binding),
the resourceclaim controller and node lifecycle controller; the translator and placement services
in this process, as their service accounts of deploy/k8s, on a real nats-server. Played: the
capacity publisher (each node's GPU inventory written into the bucket; no ResourceSlices, so the
scheduler cannot allocate the claims itself) and the nodes, Node objects without a kubelet.
"""

from __future__ import annotations

from tessera.shared import subjects
from tessera.shared.events import ClaimSpec
from tessera.shared.kubeclaims import claim_id
from tessera.shared.ledger import Ledger

from kit import eventually
from tesseraworld import NOT_READY, ZONE, World


async def test_the_pod_is_placed_on_the_one_node_the_scheduler_can_bind_it_to(world, nats_url):
    # Four nodes kube-scheduler's filters refuse for this pod, each for another reason, listed
    # first (placement, blind to the filters, took the first of equals), and one it accepts.
    await world.node("cordoned", unschedulable=True)
    await world.node("tainted", taints=({"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"},))
    await world.node("elsewhere", zone="b")
    await world.node("small", cpu="1")
    good = await world.node("good")
    async with world.tessera(nats_url) as placement:
        pod, claim = await world.pods.create(world.ns, "train", ClaimSpec(memory_mib=10240, cores=20),
                                             pod_spec={"nodeSelector": {ZONE: "a"}, "tolerations": NOT_READY},
                                             requests={"cpu": "2", "memory": "1Gi"})
        cid = claim_id(claim["metadata"]["uid"])
        assert await eventually(lambda: world.allocated_node(claim), timeout=60, what="the allocation") == good
        # kube-scheduler binds the pod there: its filters pass, and the allocation pins it there
        assert await eventually(lambda: world.bound_to("train"), timeout=60, what="the pod bound") == good
        entries = (await Ledger(await world.bus.kv(subjects.KV_LEDGER)).all_nodes())[good].entries
        assert entries[cid].pod_uid == pod["metadata"]["uid"]
        record = await world.record(cid)
        assert record.state == "allocated" and record.node == good and record.withdrawn == []
        assert record.spec.pod.node_selector == {ZONE: "a"} and record.spec.pod.requests["cpu"] == 2000
        assert placement.counts["withdrawn"] == 0


async def test_a_pod_no_node_can_take_says_which_filter_refused_how_many_and_is_placed_once_one_can(world, nats_url):
    first = await world.node("cordoned", unschedulable=True)
    await world.node("small", cpu="1")
    async with world.tessera(nats_url):
        _, claim = await world.pods.create(world.ns, "wait", ClaimSpec(memory_mib=10240, cores=20),
                                           pod_spec={"tolerations": NOT_READY}, requests={"cpu": "2"})
        cid = claim_id(claim["metadata"]["uid"])
        record = await eventually(lambda: _in_state(world, cid, "unschedulable"), timeout=60, what="unschedulable")
        assert record.reason == ("no node fits: kube-scheduler's filters refuse 2 of 2 nodes "
                                 "(1 Insufficient cpu, 1 node(s) were unschedulable)")
        assert any(e["reason"] == "Unschedulable" and "1 node(s) were unschedulable" in e["message"]
                   for e in await eventually(lambda: world.events("wait"), timeout=30))
        assert await world.allocation(claim) is None
        # uncordoned: the Node watch retries the waiting claim, and the scheduler binds it there
        world.plane.kubectl("uncordon", first)
        assert await eventually(lambda: world.allocated_node(claim), timeout=60, what="the allocation") == first
        assert await eventually(lambda: world.bound_to("wait"), timeout=60, what="the pod bound") == first


async def test_an_allocation_the_scheduler_takes_back_is_placed_again_and_the_pod_binds(world, nats_url):
    one = await world.node("one")
    two = await world.node("two")
    async with world.tessera(nats_url) as placement:
        # another gate holds the pod after ours is lifted: meanwhile its node is cordoned
        claim, placed = await world.held_pod("moved", ClaimSpec(memory_mib=10240, cores=20))
        cid = claim_id(claim["metadata"]["uid"])
        other = two if placed == one else one
        await world.cordon_and_let_go(placed, "moved")
        # kube-scheduler cannot bind it there: its PostFilter takes the allocation back; the
        # translator says so, placement takes the claim off that node and places it on the other
        assert await eventually(lambda: world.bound_to("moved"), timeout=90, what="the pod bound") == other
        assert await world.allocated_node(claim) == other
        record = await world.record(cid)
        assert record.state == "allocated" and record.node == other and record.withdrawn == [placed]
        nodes = await Ledger(await world.bus.kv(subjects.KV_LEDGER)).all_nodes()
        assert cid in nodes[other].entries and cid not in nodes.get(placed, _EMPTY).entries
        assert placement.counts["withdrawn"] == 1
        assert any(e["reason"] == "Deallocated" for e in await world.events("moved"))


class _Empty:
    entries: dict = {}


_EMPTY = _Empty()


async def _in_state(world: World, cid: str, state: str):
    record = await world.record(cid)
    return record if record is not None and record.state == state else None
