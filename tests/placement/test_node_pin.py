"""A claim pinned to a node lands there or nowhere; lost and excluded nodes get nothing."""

from fleetkit import inventory
from tessera.placement.engine import Placement, Rejection


def test_pinned_claim_lands_on_its_node(harness):
    h = harness(inventory("a"), inventory("b"), inventory("c"), default_node_policy="binpack")
    h.claim(memory_mib=1000, node="a")
    assert h.claim(memory_mib=1000, node="c").node == "c"


def test_pinned_claim_does_not_fall_back(harness):
    h = harness(inventory("a", gpus=1), inventory("b"))
    h.claim(cores=100, node="a")
    r = h.place(cores=100, node="a")
    assert isinstance(r, Rejection)
    assert r.filtered == {"node-pin": 1, "exclusive": 1}


def test_pin_to_an_unknown_node_says_so(harness):
    h = harness(inventory("a"))
    r = h.place(memory_mib=1000, node="ghost")
    assert isinstance(r, Rejection) and "ghost is unknown" in r.reason


def test_lost_nodes_get_nothing_until_they_report_again(harness):
    h = harness(inventory("a"), inventory("b"))
    h.fleet.mark_lost("a")
    for _ in range(3):
        assert h.claim(memory_mib=1000).node == "b"
    h.fleet.mark_lost("b")
    r = h.place(memory_mib=1000)
    assert isinstance(r, Rejection) and r.filtered == {"lost": 2}
    h.fleet.upsert_node(inventory("a"))
    assert isinstance(h.place(memory_mib=1000), Placement)


def test_excluded_nodes_are_skipped(harness):
    h = harness(inventory("a"), inventory("b"), default_node_policy="binpack")
    first = h.claim(memory_mib=1000)
    other = "b" if first.node == "a" else "a"
    assert h.place(memory_mib=1000, exclude_nodes=[first.node]).node == other
    r = h.place(memory_mib=1000, exclude_nodes=["a", "b"])
    assert isinstance(r, Rejection) and r.filtered == {"excluded": 2}
