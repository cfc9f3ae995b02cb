"""GPU type (case-insensitive substring, as HAMi) and UUID include/exclude selectors."""

from fleetkit import inventory
from tessera.placement.engine import Placement, Rejection


def _fleet(harness):
    return harness(inventory("h", gpus=2, model="NVIDIA H100 80GB HBM3"),
                   inventory("a", gpus=2, model="NVIDIA A100-SXM4-40GB", memory_mib=40960))


def test_use_type_matches_a_substring_case_insensitively(harness):
    h = _fleet(harness)
    for _ in range(3):
        assert h.claim(memory_mib=1000, use_types=["h100"]).node == "h"


def test_nouse_type_excludes(harness):
    h = _fleet(harness)
    assert h.claim(memory_mib=1000, nouse_types=["H100"]).node == "a"


def test_unknown_type_is_rejected_with_counts(harness):
    h = _fleet(harness)
    r = h.place(memory_mib=1000, use_types=["B200"])
    assert isinstance(r, Rejection)
    assert r.filtered == {"gpu-type": 2}
    assert "use: b200" in r.reason


def test_use_uuid_picks_that_gpu(harness):
    h = _fleet(harness)
    r = h.place(memory_mib=1000, use_uuids=["GPU-a-1"])
    assert isinstance(r, Placement) and r.node == "a" and [s.uuid for s in r.shares] == ["GPU-a-1"]


def test_nouse_uuid_avoids_that_gpu(harness):
    h = harness(inventory("a", gpus=2))
    for _ in range(4):
        r = h.claim(memory_mib=1000, nouse_uuids=["GPU-a-0"])
        assert r.shares[0].uuid == "GPU-a-1"


def test_uuid_selectors_that_match_nothing_are_explained(harness):
    h = _fleet(harness)
    r = h.place(memory_mib=1000, use_uuids=["GPU-nowhere"])
    assert isinstance(r, Rejection) and r.filtered == {"gpu-uuid": 2}


def test_unhealthy_gpus_are_never_used(harness):
    h = harness(inventory("a", gpus=2, unhealthy=(0,)))
    for _ in range(3):
        assert h.claim(memory_mib=1000).shares[0].index == 1
    r = h.place(gpus=2, memory_mib=1000)
    assert isinstance(r, Rejection) and r.filtered == {"gpu-count": 1}
