"""A multi-GPU claim lands all its GPUs on one node, on distinct GPUs."""

from fleetkit import inventory
from tessera.placement.engine import Rejection


def test_multi_gpu_claim_gets_distinct_gpus_on_one_node(harness):
    h = harness(inventory("a", gpus=4), inventory("b", gpus=4))
    r = h.claim(gpus=4, cores=100)
    assert len({s.uuid for s in r.shares}) == 4
    assert all(s.uuid.startswith(f"GPU-{r.node}-") for s in r.shares)


def test_multi_gpu_claim_is_not_split_across_nodes(harness):
    h = harness(inventory("a", gpus=2), inventory("b", gpus=2))
    r = h.place(gpus=3, cores=100)
    assert isinstance(r, Rejection)
    assert r.filtered == {"gpu-count": 2}
    assert "fewer than 3 GPUs" in r.reason


def test_shared_multi_gpu_claim_uses_distinct_gpus(harness):
    for policy in ("binpack", "spread", "best-fit", "fragmentation-aware"):
        h = harness(inventory("a", gpus=4), default_node_policy=policy)
        r = h.claim(gpus=3, memory_mib=20000, cores=30)
        assert len({s.uuid for s in r.shares}) == 3, policy
        assert all(s.memory_mib == 20000 and s.cores == 30 for s in r.shares)
