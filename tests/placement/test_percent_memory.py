"""Memory per GPU as a percent of each card, or the whole card when neither size is given."""

from fleetkit import inventory
from tessera.placement.engine import Rejection


def test_percent_is_of_the_card_it_lands_on(harness):
    h = harness(inventory("big", gpus=1, memory_mib=81920), inventory("small", gpus=1, memory_mib=16384))
    r = h.claim(memory_percent=50, use_types=["a100"], node="small")
    assert r.shares[0].memory_mib == 8192
    r = h.claim(memory_percent=25, node="big")
    assert r.shares[0].memory_mib == 20480


def test_percent_claims_fill_a_card_exactly(harness):
    h = harness(inventory("a", gpus=1, memory_mib=16000))
    for _ in range(4):
        h.claim(memory_percent=25)
    r = h.place(memory_percent=25)
    assert isinstance(r, Rejection) and r.filtered == {"memory": 1}
    assert "25% of memory free" in r.reason


def test_no_memory_size_means_the_whole_card(harness):
    h = harness(inventory("a", gpus=2))
    r = h.claim(cores=10)
    assert r.shares[0].memory_mib == 81920
    assert h.claim(cores=10).shares[0].uuid != r.shares[0].uuid
