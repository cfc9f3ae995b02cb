"""cores=100 is exclusive use: the GPU must have no other share, and no one may join it."""

from fleetkit import inventory
from tessera.placement.engine import Rejection


def test_exclusive_claim_takes_an_untouched_gpu(harness):
    h = harness(inventory("a", gpus=2))
    slice_ = h.claim(memory_mib=1000, cores=10)
    whole = h.claim(cores=100)
    assert whole.shares[0].uuid != slice_.shares[0].uuid
    assert whole.shares[0].memory_mib == 81920


def test_nobody_joins_an_exclusive_gpu(harness):
    h = harness(inventory("a", gpus=1))
    h.claim(cores=100, memory_mib=1000)
    r = h.place(memory_mib=1000, cores=0)
    assert isinstance(r, Rejection)
    assert r.filtered == {"exclusive": 1}


def test_exclusive_is_refused_where_a_share_already_sits(harness):
    h = harness(inventory("a", gpus=1))
    h.claim(memory_mib=1000, cores=5)
    r = h.place(cores=100)
    assert isinstance(r, Rejection)
    assert r.filtered == {"exclusive": 1}
    assert "no other share" in r.reason


def test_cores_zero_is_still_a_share(harness):
    h = harness(inventory("a", gpus=1, max_shares=2))
    h.claim(memory_mib=1000, cores=0)
    h.claim(memory_mib=1000, cores=0)
    r = h.place(memory_mib=1000, cores=0)
    assert isinstance(r, Rejection) and r.filtered == {"max-shares": 1}
