"""binpack (HAMi semantics): the most used node first, and the most used GPU within it."""

from fleetkit import inventory


def test_binpack_fills_the_most_used_node_first(harness):
    h = harness(inventory("a"), inventory("b"), default_node_policy="binpack")
    first = h.claim(memory_mib=10000, cores=20)
    for _ in range(5):
        assert h.claim(memory_mib=10000, cores=20).node == first.node


def test_binpack_prefers_the_most_used_gpu_on_the_node(harness):
    h = harness(inventory("a"), default_node_policy="binpack")
    first = h.claim(memory_mib=10000, cores=20)
    second = h.claim(memory_mib=10000, cores=20)
    assert second.shares[0].uuid == first.shares[0].uuid


def test_binpack_moves_on_when_the_node_is_full(harness):
    h = harness(inventory("a", gpus=1), inventory("b", gpus=1), default_node_policy="binpack")
    nodes = {h.claim(memory_percent=50, cores=50).node for _ in range(2)}
    assert len(nodes) == 1
    assert h.claim(memory_percent=50, cores=50).node not in nodes
