"""The cluster's Nodes and pods as placement keeps them (`clusternodes`), the nodes kube-scheduler's
filters rule out for a pod, and the decision made without them (`PlacementService._decide`): the
best node the filters leave, elsewhere than where the scheduler took the claim back while another
fits, and a rejection that says which filter refused how many nodes."""

from __future__ import annotations

from types import SimpleNamespace

from tessera.placement.clusternodes import ClusterNodes, refused
from tessera.placement.engine import Placement, Rejection
from tessera.placement.nodefilters import Usage
from tessera.placement.service import PlacementService, PlacementSettings
from tessera.shared.events import ClaimSpec, LedgerEntry, NodeLedger, encode
from tessera.shared.kubeclaims import KubeClaimRef
from tessera.shared.podconstraints import PodConstraints, Toleration
from tessera.shared.runner import ServiceContext
from tessera.shared.telemetry import Telemetry

from fleetkit import Harness, inventory


def node(name: str, *, cpu: str = "8", memory: str = "32Gi", pods: str = "110", unschedulable: bool = False,
         taints=(), labels=None) -> dict:
    return {"metadata": {"name": name, "labels": labels or {"kubernetes.io/hostname": name}},
            "spec": {"unschedulable": unschedulable, "taints": [dict(t) for t in taints]},
            "status": {"allocatable": {"cpu": cpu, "memory": memory, "pods": pods}}}


def pod_obj(uid: str, node_name: str = "", cpu: str = "1", memory: str = "1Gi", phase: str = "Running") -> dict:
    return {"metadata": {"uid": uid, "name": uid, "namespace": "ns"},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "resources": {
                "requests": {"cpu": cpu, "memory": memory}}}]},
            "status": {"phase": phase}}


def test_the_table_sums_what_the_bound_pods_request_and_ignores_heartbeats():
    table = ClusterNodes()
    assert table.set_node(node("a"))
    assert not table.set_node(node("a"))  # the same state again (a kubelet's status heartbeat)
    assert table.set_node(node("a", unschedulable=True))
    table.set_pod(pod_obj("p1", "a", cpu="2"))
    table.set_pod(pod_obj("p2", "a", cpu="500m"))
    table.set_pod(pod_obj("p3"))  # pending: counts nowhere
    usage = table.usage("a")
    assert usage.requests == {"cpu": 2500, "memory": 2 << 30} and usage.pods == 2
    assert table.set_pod(pod_obj("p1", "a", cpu="2", phase="Succeeded"))  # over: room again
    assert table.usage("a").requests["cpu"] == 500
    assert table.remove_pod(pod_obj("p2", "a"))
    assert table.usage("a") == Usage()
    assert table.unbound == {"p3"}


def test_exclusions_name_the_filter_and_the_schedulers_reasons_per_node():
    table = ClusterNodes()
    table.set_node(node("cordoned", unschedulable=True))
    table.set_node(node("tainted", taints=[{"key": "maintenance", "value": "true", "effect": "NoSchedule"}]))
    table.set_node(node("elsewhere", labels={"zone": "b"}))
    table.set_node(node("small", cpu="1"))
    table.set_node(node("ok"))
    ask = PodConstraints(requests={"cpu": 2000})
    out = table.exclusions(ask, ["cordoned", "tainted", "elsewhere", "small", "ok", "ghost"])
    assert out.nodes == {"cordoned", "tainted", "small", "ghost"}
    assert out.filtered == {"NodeUnschedulable": 1, "TaintToleration": 1, "NodeResourcesFit": 1, "NodeMissing": 1}
    assert out.describe() == ("1 Insufficient cpu, 1 node(s) had untolerated taint(s), 1 node(s) not found in "
                              "the cluster, 1 node(s) were unschedulable")
    picky = PodConstraints(node_selector={"zone": "b"},
                           tolerations=[Toleration(operator="Exists")])  # tolerates the cordon and the taint
    assert table.exclusions(picky, ["cordoned", "tainted", "elsewhere", "ok"]).nodes == {"cordoned", "tainted", "ok"}


def test_a_pod_placed_and_not_yet_bound_counts_on_its_node():
    table = ClusterNodes()
    table.set_node(node("a", cpu="4"))
    table.set_pod(pod_obj("placed", cpu="3"))  # unbound, its claim's ledger entry on a
    ask = PodConstraints(requests={"cpu": 2000})
    assert table.exclusions(ask, ["a"]).nodes == frozenset()
    assert table.exclusions(ask, ["a"], {"placed": "a"}).nodes == {"a"}
    assert table.exclusions(ask, ["a"], {"placed": "a"}, own_pod="placed").nodes == frozenset()  # not against itself
    table.set_pod(pod_obj("placed", "a", cpu="3"))  # bound now: counted once, as bound
    assert table.usage("a", table.inflight({"placed": "a"})).requests["cpu"] == 3000


def test_the_engine_takes_the_best_node_the_exclusions_leave():
    h = Harness(inventory("a", gpus=1), inventory("b", gpus=1), inventory("c", gpus=1), default_node_policy="binpack")
    h.claim(memory_mib=40000, node="b")  # binpack now prefers b, then a and c alike
    assert h.place(memory_mib=1000).node == "b"
    assert h.place(memory_mib=1000, exclude_nodes={"b"}).node in {"a", "c"}
    assert h.place(memory_mib=1000, exclude_nodes={"b", "a"}).node == "c"
    rejected = h.place(memory_mib=50000, exclude_nodes={"a", "c"})
    assert isinstance(rejected, Rejection) and rejected.filtered == {"excluded": 2, "memory": 1}


def test_a_rejection_counts_the_excluded_nodes_by_filter():
    h = Harness(inventory("a", gpus=1), inventory("b", gpus=1))
    table = ClusterNodes()
    table.set_node(node("a", unschedulable=True))
    table.set_node(node("b"))
    out = table.exclusions(PodConstraints(), ["a", "b"])
    r = refused(h.place(memory_mib=90000, exclude_nodes=out.nodes), out, 2)
    assert r.filtered == {"NodeUnschedulable": 1, "memory": 1}
    assert r.reason == ("no node fits: kube-scheduler's filters refuse 1 of 2 nodes (1 node(s) were unschedulable), "
                        "1 node lack 1 GPU with 90,000 MiB free")
    table.set_node(node("b", unschedulable=True))
    out = table.exclusions(PodConstraints(), ["a", "b"])
    r = refused(h.place(memory_mib=1000, exclude_nodes=out.nodes), out, 2)
    assert r.reason == "no node fits: kube-scheduler's filters refuse 2 of 2 nodes (2 node(s) were unschedulable)"
    assert r.filtered == {"NodeUnschedulable": 2}


def _service(*names: str) -> PlacementService:
    ctx = ServiceContext(settings=SimpleNamespace(instance="t", service="placement", metrics_legacy=True), bus=None,
                         telemetry=Telemetry("placement", None))
    svc = PlacementService(ctx, PlacementSettings(default_policy="binpack"))
    for name in names:
        svc.view.on_inventory(name, encode(inventory(name, gpus=1)), 1, "PUT")
    svc.cluster = ClusterNodes()
    return svc


def test_the_decision_honours_the_filters_and_avoids_where_the_scheduler_took_the_claim_back():
    svc = _service("a", "b", "c")
    for name in ("a", "b", "c"):
        svc.cluster.set_node(node(name))
    spec = ClaimSpec(memory_mib=1000, pod=PodConstraints())
    svc.view.remember("a", NodeLedger(node="a", entries={"x": LedgerEntry(claim="x", tenant="t", shares=[])}), 1)
    first = svc._decide("c1", "t", spec)
    assert isinstance(first, Placement)
    svc.cluster.set_node(node(first.node, unschedulable=True))
    second = svc._decide("c2", "t", spec)
    assert isinstance(second, Placement) and second.node != first.node
    # taken back from the second's node: elsewhere while another node fits ...
    third = svc._decide("c3", "t", spec, withdrawn=[second.node])
    assert isinstance(third, Placement) and third.node not in (first.node, second.node)
    # ... and there again rather than nowhere
    svc.cluster.set_node(node(third.node, labels={"zone": "x"}))
    picky = ClaimSpec(memory_mib=1000, pod=PodConstraints(node_selector={"kubernetes.io/hostname": second.node}))
    again = svc._decide("c4", "t", picky, withdrawn=[second.node])
    assert isinstance(again, Placement) and again.node == second.node
    # a claim that carries no pod constraints is placed as before
    assert isinstance(svc._decide("c5", "t", ClaimSpec(memory_mib=1000)), Placement)


def test_a_pod_placed_in_the_same_batch_counts_against_the_next():
    svc = _service("a", "b")
    svc.cluster.set_node(node("a", cpu="4"))
    svc.cluster.set_node(node("b", cpu="4"))
    for uid in ("p1", "p2"):
        svc.cluster.set_pod(pod_obj(uid, cpu="3"))
    ask = ClaimSpec(memory_mib=1000, pod=PodConstraints(requests={"cpu": 3000}))
    first = svc._decide("c1", "t", ask, KubeClaimRef(namespace="ns", name="c1", uid="u1", pod="p1", pod_uid="p1"))
    assert isinstance(first, Placement)
    svc.view.book(first.node, LedgerEntry(claim="c1", tenant="t", shares=first.shares, pod_uid="p1"))
    second = svc._decide("c2", "t", ask, KubeClaimRef(namespace="ns", name="c2", uid="u2", pod="p2", pod_uid="p2"))
    assert isinstance(second, Placement) and second.node != first.node


class _Api:
    """KubeApi's watch as ClusterWatch uses it: a list (ADDED each, then ``listed``), then quiet."""

    def __init__(self, nodes: list[dict], pods: list[dict]) -> None:
        self.items = {"/api/v1/nodes": nodes, "/api/v1/pods": pods}
        self.selectors: list = []

    async def watch(self, path, field_selector=None, listed=None):
        import asyncio

        self.selectors.append((path, field_selector))
        for item in self.items[path]:
            yield "ADDED", item
        listed()
        await asyncio.Event().wait()


async def test_the_watch_loads_the_table_opens_the_gate_and_drops_what_a_restart_did_not_list():
    import asyncio

    from tessera.placement.kube import ClusterWatch

    table = ClusterNodes()
    table.set_node(node("gone-while-we-were-away"))
    table.set_pod(pod_obj("old", "a"))
    loaded, changed = [], []
    watch = ClusterWatch(_Api([node("a")], [pod_obj("p", "a")]), table, lambda: changed.append(1),
                         lambda: loaded.append(1))
    task = asyncio.create_task(watch.run())
    try:
        for _ in range(100):
            if loaded:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert loaded == [1] and changed
    assert set(table.nodes) == {"a"} and set(table.pods) == {"p"}
    assert ("/api/v1/pods", "status.phase!=Succeeded,status.phase!=Failed") in watch.api.selectors


def test_the_nodes_too_full_are_kept_up_to_date_as_pods_come_and_go():
    table = ClusterNodes()
    for name in ("a", "b"):
        table.set_node(node(name, cpu="4"))
    ask = PodConstraints(requests={"cpu": 2000})
    assert table.exclusions(ask, {"a", "b"}, roster=1).nodes == frozenset()
    table.set_pod(pod_obj("p1", "a", cpu="3"))
    assert table.exclusions(ask, {"a", "b"}, roster=1).nodes == {"a"}
    table.set_pod(pod_obj("p2", "b", cpu="3"))
    table.remove_pod(pod_obj("p1", "a"))
    assert table.exclusions(ask, {"a", "b"}, roster=1).nodes == {"b"}
    table.set_node(node("a", cpu="1"))  # a node changed: everything is worked out again
    assert table.exclusions(ask, {"a", "b"}, roster=1).nodes == {"a", "b"}
    assert table.exclusions(ask, {"b"}, roster=2).nodes == {"b"}  # other candidates
