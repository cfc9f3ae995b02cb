"""spread (HAMi semantics): the least used node first, and the least used GPU within it."""

from fleetkit import inventory


def test_spread_puts_each_claim_on_the_least_used_node(harness):
    h = harness(inventory("a"), inventory("b"), inventory("c"), default_node_policy="spread")
    nodes = [h.claim(memory_mib=10000, cores=10).node for _ in range(3)]
    assert sorted(nodes) == ["a", "b", "c"]


def test_spread_uses_a_fresh_gpu_within_the_node(harness):
    h = harness(inventory("a", gpus=4), default_node_policy="spread")
    uuids = [h.claim(memory_mib=10000, cores=10).shares[0].uuid for _ in range(4)]
    assert len(set(uuids)) == 4


def test_claim_policy_overrides_the_default(harness):
    h = harness(inventory("a"), inventory("b"), default_node_policy="binpack")
    first = h.claim(memory_mib=10000)
    assert h.claim(memory_mib=10000, node_policy="spread", gpu_policy="spread").node != first.node
