"""kube-scheduler's node filters as placement applies them (`tessera.placement.nodefilters`), one rule
at a time, each case as the scheduler's own plugin decides it (Kubernetes v1.36: NodeUnschedulable,
TaintToleration, NodeAffinity, NodeResourcesFit; the pod's requests as component-helpers computes
them)."""

from __future__ import annotations

import pytest

from tessera.placement import nodefilters as nf
from tessera.placement.nodefilters import NodeState, Taint, Usage
from tessera.shared.podconstraints import (NodeSelectorRequirement as Req, NodeSelectorTerm as Term,
                                           PodConstraints, Toleration, constraints_of, pod_requests)

NODE = NodeState(name="gpu-1", labels={"zone": "a", "gpu": "h100", "rank": "5"},
                 allocatable={"cpu": 8000, "memory": 32 << 30, "pods": 110, "ephemeral-storage": 100 << 30})


def pod(**kw) -> PodConstraints:
    return PodConstraints(**kw)


# --- NodeUnschedulable ---------------------------------------------------------------------------

def test_a_cordoned_node_is_refused_unless_the_pod_tolerates_the_unschedulable_taint():
    cordoned = NodeState(name="n", unschedulable=True, allocatable={"pods": 10})
    assert nf.node_unschedulable(pod(), cordoned)
    assert not nf.node_unschedulable(pod(), NodeState(name="n"))
    key = "node.kubernetes.io/unschedulable"
    assert not nf.node_unschedulable(pod(tolerations=[Toleration(key=key, operator="Exists")]), cordoned)
    assert not nf.node_unschedulable(pod(tolerations=[Toleration(key=key, operator="Exists", effect="NoSchedule")]),
                                     cordoned)
    assert not nf.node_unschedulable(pod(tolerations=[Toleration(operator="Exists")]), cordoned)  # tolerates all
    assert nf.node_unschedulable(pod(tolerations=[Toleration(key=key, operator="Exists", effect="NoExecute")]),
                                 cordoned)
    assert nf.refusal(pod(), cordoned, Usage()) == nf.Refusal("NodeUnschedulable", ("node(s) were unschedulable",))


# --- TaintToleration -----------------------------------------------------------------------------

def test_tolerations_match_taints_as_toleratestaint_does():
    taint = Taint("gpu", "true", "NoSchedule")
    assert nf.tolerates(Toleration(key="gpu", operator="Equal", value="true", effect="NoSchedule"), taint)
    assert nf.tolerates(Toleration(key="gpu", value="true"), taint)  # no operator: Equal; no effect: all
    assert not nf.tolerates(Toleration(key="gpu", value="false"), taint)
    assert nf.tolerates(Toleration(key="gpu", operator="Exists"), taint)
    assert not nf.tolerates(Toleration(key="gpu", operator="Exists", effect="NoExecute"), taint)
    assert nf.tolerates(Toleration(operator="Exists"), taint)  # empty key + Exists: every taint
    assert not nf.tolerates(Toleration(key="other", operator="Exists"), taint)
    assert not nf.tolerates(Toleration(key="gpu", operator="Sometimes"), taint)


def test_lt_and_gt_tolerate_nothing_while_their_gate_is_off_and_compare_integers_when_on():
    taint = Taint("priority", "5", "NoSchedule")
    gt = Toleration(key="priority", operator="Gt", value="3")
    lt = Toleration(key="priority", operator="Lt", value="3")
    assert not nf.tolerates(gt, taint)  # TaintTolerationComparisonOperators: alpha, off in 1.36
    assert nf.tolerates(gt, taint, comparison_operators=True)
    assert not nf.tolerates(lt, taint, comparison_operators=True)
    assert not nf.tolerates(gt, Taint("priority", "five", "NoSchedule"), comparison_operators=True)
    assert not nf.tolerates(Toleration(key="priority", operator="Gt", value="3.5"), taint, comparison_operators=True)


def test_only_noschedule_and_noexecute_taints_refuse_a_node():
    prefer = NodeState(name="n", taints=(Taint("x", "", "PreferNoSchedule"),), allocatable={"pods": 1})
    assert not nf.taint_toleration(pod(), prefer)
    for effect in ("NoSchedule", "NoExecute"):
        node = NodeState(name="n", taints=(Taint("x", "1", effect),))
        assert nf.taint_toleration(pod(), node)
        assert not nf.taint_toleration(pod(tolerations=[Toleration(key="x", value="1", effect=effect)]), node)
    two = NodeState(name="n", taints=(Taint("a", "", "NoSchedule"), Taint("b", "", "NoExecute")))
    assert nf.taint_toleration(pod(tolerations=[Toleration(key="a", operator="Exists")]), two)
    assert not nf.taint_toleration(pod(tolerations=[Toleration(key="a", operator="Exists"),
                                                    Toleration(key="b", operator="Exists")]), two)
    assert nf.refusal(pod(), two, Usage()).reasons == ("node(s) had untolerated taint(s)",)


# --- NodeAffinity ----------------------------------------------------------------------------------

def test_the_node_selector_needs_every_label_with_its_value():
    assert not nf.node_affinity(pod(node_selector={"zone": "a"}), NODE)
    assert not nf.node_affinity(pod(node_selector={"zone": "a", "gpu": "h100"}), NODE)
    assert nf.node_affinity(pod(node_selector={"zone": "b"}), NODE)
    assert nf.node_affinity(pod(node_selector={"missing": ""}), NODE)


@pytest.mark.parametrize(("operator", "values", "matches"), [
    ("In", ["a", "b"], True), ("In", ["b"], False),
    ("NotIn", ["b"], True), ("NotIn", ["a"], False),
    ("Exists", [], True), ("DoesNotExist", [], False),
    ("In", [], False),  # invalid (In needs values): the term matches nothing
    ("Exists", ["a"], False),  # invalid (Exists takes none)
    ("Sometimes", ["a"], False),  # not an operator
])
def test_match_expressions_on_an_existing_label(operator, values, matches):
    term = Term(match_expressions=[Req(key="zone", operator=operator, values=values)])
    assert nf.term_matches(term, NODE) is matches


def test_match_expressions_on_a_missing_label():
    def on_missing(operator, values=()):
        return nf.term_matches(Term(match_expressions=[Req(key="nope", operator=operator, values=list(values))]), NODE)
    assert not on_missing("In", ["a"])
    assert on_missing("NotIn", ["a"])  # a label that is absent is not in any set
    assert not on_missing("Exists")
    assert on_missing("DoesNotExist")
    assert not on_missing("Gt", ["1"])


def test_gt_and_lt_compare_a_label_as_an_integer():
    def rank(operator, value, labels=None):
        node = NodeState(name="n", labels=labels if labels is not None else NODE.labels)
        return nf.term_matches(Term(match_expressions=[Req(key="rank", operator=operator, values=[value])]), node)
    assert rank("Gt", "4") and not rank("Gt", "5") and rank("Lt", "6") and not rank("Lt", "5")
    assert rank("Gt", "-1") and rank("Gt", "+4")
    assert not rank("Gt", "four")  # invalid requirement
    assert not rank("Gt", "1", {"rank": "high"})  # the label is no integer
    assert not rank("Gt", "1", {"rank": "1.5"})


def test_match_fields_compare_the_node_name():
    def fields(operator, values):
        return nf.term_matches(Term(match_fields=[Req(key="metadata.name", operator=operator, values=values)]), NODE)
    assert fields("In", ["gpu-1"]) and not fields("In", ["gpu-2"])
    assert fields("NotIn", ["gpu-2"]) and not fields("NotIn", ["gpu-1"])
    assert not fields("In", ["gpu-1", "gpu-2"])  # a field requirement takes exactly one value
    assert not fields("Exists", [])


def test_terms_are_ored_and_requirements_anded_and_empty_terms_match_nothing():
    zone_b = Term(match_expressions=[Req(key="zone", operator="In", values=["b"])])
    zone_a_h100 = Term(match_expressions=[Req(key="zone", operator="In", values=["a"]),
                                          Req(key="gpu", operator="In", values=["h100"])])
    zone_a_a100 = Term(match_expressions=[Req(key="zone", operator="In", values=["a"]),
                                          Req(key="gpu", operator="In", values=["a100"])])
    assert not nf.node_affinity(pod(required_terms=[zone_b, zone_a_h100]), NODE)
    assert nf.node_affinity(pod(required_terms=[zone_b, zone_a_a100]), NODE)
    assert nf.node_affinity(pod(required_terms=[Term()]), NODE)  # an empty term is skipped: none left
    assert not nf.node_affinity(pod(required_terms=[Term(), zone_a_h100]), NODE)
    assert nf.node_affinity(pod(required_terms=[]), NODE)
    both = Term(match_expressions=[Req(key="zone", operator="In", values=["a"])],
                match_fields=[Req(key="metadata.name", operator="In", values=["gpu-2"])])
    assert not nf.term_matches(both, NODE)  # expressions and fields must both match
    # an invalid requirement fails its term even after one that does not match
    assert not nf.term_matches(Term(match_expressions=[Req(key="zone", operator="In", values=["b"]),
                                                       Req(key="x", operator="Bad")]), NODE)


def test_the_selector_and_the_affinity_must_both_pass():
    affinity = [Term(match_expressions=[Req(key="zone", operator="In", values=["a"])])]
    assert not nf.node_affinity(pod(node_selector={"gpu": "h100"}, required_terms=affinity), NODE)
    assert nf.node_affinity(pod(node_selector={"gpu": "a100"}, required_terms=affinity), NODE)
    assert nf.refusal(pod(node_selector={"gpu": "a100"}), NODE, Usage()) == \
        nf.Refusal("NodeAffinity", ("node(s) didn't match Pod's node affinity/selector",))


# --- NodeResourcesFit -------------------------------------------------------------------------------

def test_a_pod_needs_a_free_pod_slot_even_asking_for_nothing():
    assert nf.insufficient(pod(), NODE, Usage(pods=109)) == ()
    assert nf.insufficient(pod(), NODE, Usage(pods=110)) == ("Too many pods",)
    assert nf.insufficient(pod(), NodeState(name="no-status"), Usage()) == ("Too many pods",)


def test_requests_are_held_against_allocatable_less_what_is_requested_there():
    asks = pod(requests={"cpu": 2000, "memory": 4 << 30})
    assert nf.insufficient(asks, NODE, Usage({"cpu": 6000, "memory": 28 << 30}, 3)) == ()
    assert nf.insufficient(asks, NODE, Usage({"cpu": 6001}, 3)) == ("Insufficient cpu",)
    assert nf.insufficient(asks, NODE, Usage({"cpu": 7000, "memory": 30 << 30}, 110)) == \
        ("Too many pods", "Insufficient cpu", "Insufficient memory")
    assert nf.insufficient(pod(requests={"ephemeral-storage": 200 << 30}), NODE, Usage()) == \
        ("Insufficient ephemeral-storage",)
    assert nf.insufficient(pod(requests={"example.com/fpga": 1}), NODE, Usage()) == ("Insufficient example.com/fpga",)
    fpga = NodeState(name="f", allocatable={"pods": 10, "example.com/fpga": 2})
    assert nf.insufficient(pod(requests={"example.com/fpga": 1}), fpga, Usage({"example.com/fpga": 1}, 1)) == ()
    assert nf.resources_refusal(asks, NODE, Usage({"cpu": 8000}, 1)).filter == "NodeResourcesFit"


def test_the_filters_run_in_the_schedulers_order_and_the_first_refusal_names_the_node():
    node = NodeState(name="n", unschedulable=True, taints=(Taint("t", "", "NoSchedule"),), labels={})
    assert nf.refusal(pod(node_selector={"zone": "a"}), node, Usage()).filter == "NodeUnschedulable"
    tolerant = pod(tolerations=[Toleration(key="node.kubernetes.io/unschedulable", operator="Exists")],
                   node_selector={"zone": "a"})
    assert nf.refusal(tolerant, node, Usage()).filter == "TaintToleration"
    assert nf.describe({"Insufficient cpu": 1, "node(s) were unschedulable": 2}) == \
        "1 Insufficient cpu, 2 node(s) were unschedulable"


# --- the pod's requests (component-helpers' PodRequests) -------------------------------------------

def _container(name, **requests):
    return {"name": name, "resources": {"requests": requests}}


def test_pod_requests_sum_containers_take_the_init_peak_and_add_the_overhead():
    spec = {"containers": [_container("a", cpu="500m", memory="1Gi"), _container("b", cpu="1", memory="512Mi")],
            "initContainers": [_container("init", cpu="2", memory="256Mi")],
            "overhead": {"cpu": "100m", "memory": "64Mi"}}
    assert pod_requests({"spec": spec}) == {"cpu": 2100, "memory": (1 << 30) + (512 << 20) + (64 << 20)}


def test_sidecars_run_beside_the_containers_and_the_later_init_containers():
    spec = {"containers": [_container("main", cpu="1")],
            "initContainers": [{**_container("sidecar", cpu="500m"), "restartPolicy": "Always"},
                               _container("setup", cpu="2")]}
    # containers 1 + sidecar 0.5 = 1.5; the init peak is setup 2 + sidecar 0.5 = 2.5
    assert pod_requests({"spec": spec}) == {"cpu": 2500}


def test_pod_level_requests_stand_for_the_containers_and_quantities_round_up():
    spec = {"containers": [_container("a", cpu="3", memory="1Gi", **{"example.com/nic": "1"})],
            "resources": {"requests": {"cpu": "1500m"}}}
    assert pod_requests({"spec": spec}) == {"cpu": 1500, "memory": 1 << 30, "example.com/nic": 1}
    assert pod_requests({"spec": {"containers": [_container("a", cpu="0.0001", memory="1.5")]}}) == \
        {"cpu": 1, "memory": 2}  # MilliValue and Value round up
    assert pod_requests({"spec": {"containers": [_container("a", unknown="3")]}}) == {}


def test_a_running_pods_resized_resources_count_where_they_are_more():
    obj = {"spec": {"nodeName": "n", "containers": [_container("a", cpu="1")]},
           "status": {"containerStatuses": [{"name": "a", "resources": {"requests": {"cpu": "2"}}}]}}
    assert pod_requests(obj) == {"cpu": 1000}
    assert pod_requests(obj, use_status=True) == {"cpu": 2000}


def test_constraints_are_read_from_a_pod_object():
    obj = {"spec": {"nodeSelector": {"zone": "a"},
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In",
                                                                     "values": ["h100"]}]}]}}},
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [_container("a", cpu="250m")]}}
    got = constraints_of(obj)
    assert got == PodConstraints(node_selector={"zone": "a"},
                                 required_terms=[Term(match_expressions=[Req(key="gpu", operator="In",
                                                                             values=["h100"])])],
                                 tolerations=[Toleration(key="gpu", operator="Exists", effect="NoSchedule")],
                                 requests={"cpu": 250})
    assert constraints_of({"spec": {}}) == PodConstraints()
