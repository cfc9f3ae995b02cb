"""A GPU takes at most its device's share limit (HAMi's deviceSplitCount)."""

from fleetkit import inventory
from tessera.placement.engine import Rejection


def test_share_limit_caps_claims_per_gpu(harness):
    h = harness(inventory("a", gpus=1, max_shares=3))
    for _ in range(3):
        h.claim(memory_mib=100, cores=1)
    r = h.place(memory_mib=100, cores=1)
    assert isinstance(r, Rejection)
    assert r.filtered == {"max-shares": 1}
    assert "below their share limit" in r.reason


def test_release_frees_a_share(harness):
    h = harness(inventory("a", gpus=1, max_shares=1))
    h.claim(memory_mib=100)
    assert isinstance(h.place(memory_mib=100), Rejection)
    h.fleet.release("a", "c1")
    assert h.claim(memory_mib=100).node == "a"
