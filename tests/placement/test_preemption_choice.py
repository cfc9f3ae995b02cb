"""Which claims a claim that fits nowhere may preempt on one node (`tessera.placement.preemption`).

The order under test, as the module states it: fewest victims, then the lowest priorities, then
the least memory left stranded by the preemption, then the youngest victims; never a claim of
equal or higher priority, never a non-preemptible one.
"""

from tessera.placement.preemption import Need, NoVictims, Victims, choose_victims
from tessera.shared.events import DeviceShare, GpuDevice, LedgerEntry

MIB = 81920


def gpu(i: int, max_shares: int = 10) -> GpuDevice:
    return GpuDevice(uuid=f"GPU-{i}", index=i, model="H100", memory_mib=MIB, max_shares=max_shares)


def held(claim: str, on: int, memory_mib: int, cores: int = 0, priority: int = 0, ts: float = 1.0,
         preemptible: bool = True) -> LedgerEntry:
    return LedgerEntry(claim=claim, tenant="t", ts=ts, priority=priority, preemptible=preemptible,
                       shares=[DeviceShare(uuid=f"GPU-{on}", index=on, memory_mib=memory_mib, cores=cores)])


def entries(*es: LedgerEntry) -> dict[str, LedgerEntry]:
    return {e.claim: e for e in es}


def test_one_victim_rather_than_two():
    node = entries(held("a", 0, 40000), held("b", 0, 40000), held("big", 1, 80000))
    got = choose_victims(Need(gpus=1, memory_mib=80000), [gpu(0), gpu(1)], node, priority=50)
    assert isinstance(got, Victims)
    assert got.claims == ["big"]


def test_lowest_priority_among_equally_many():
    node = entries(held("p10", 0, 80000, priority=10), held("p5", 1, 80000, priority=5))
    got = choose_victims(Need(gpus=1, memory_mib=60000), [gpu(0), gpu(1)], node, priority=50)
    assert isinstance(got, Victims) and got.claims == ["p5"]


def test_least_memory_stranded_among_equal_priorities():
    node = entries(held("wide", 0, 80000), held("snug", 1, 30000), held("rest", 1, 50000, priority=60))
    got = choose_victims(Need(gpus=1, memory_mib=30000), [gpu(0), gpu(1)], node, priority=50)
    assert isinstance(got, Victims) and got.claims == ["snug"]


def test_youngest_among_otherwise_equal():
    node = entries(held("old", 0, 80000, ts=100.0), held("young", 1, 80000, ts=200.0))
    got = choose_victims(Need(gpus=1, memory_mib=80000), [gpu(0), gpu(1)], node, priority=50)
    assert isinstance(got, Victims) and got.claims == ["young"]


def test_never_equal_or_higher_priority():
    node = entries(held("same", 0, MIB, priority=50), held("higher", 1, MIB, priority=70))
    got = choose_victims(Need(gpus=1, memory_mib=1000), [gpu(0), gpu(1)], node, priority=50)
    assert isinstance(got, NoVictims)
    assert "priority" in got.reason


def test_never_a_non_preemptible_claim():
    node = entries(held("guarded", 0, MIB, preemptible=False), held("other", 1, MIB, priority=60))
    got = choose_victims(Need(gpus=1, memory_mib=1000), [gpu(0), gpu(1)], node, priority=50)
    assert isinstance(got, NoVictims)
    assert "non-preemptible" in got.reason


def test_no_preemption_when_it_fits_already():
    node = entries(held("a", 0, 40000))
    got = choose_victims(Need(gpus=1, memory_mib=40000), [gpu(0)], node, priority=50)
    assert isinstance(got, Victims) and got.claims == []


def test_several_gpus_need_a_victim_on_each():
    node = entries(held("a", 0, 80000, priority=1), held("b", 1, 80000, priority=2),
                   held("c", 2, 80000, priority=3))
    got = choose_victims(Need(gpus=2, memory_mib=80000), [gpu(0), gpu(1), gpu(2)], node, priority=50)
    assert isinstance(got, Victims) and sorted(got.claims) == ["a", "b"]


def test_a_share_slot_counts_as_much_as_memory():
    node = entries(held("x", 0, 1000, priority=3), held("y", 0, 1000, priority=1))
    got = choose_victims(Need(gpus=1, memory_mib=1000), [gpu(0, max_shares=2)], node, priority=50)
    assert isinstance(got, Victims) and got.claims == ["y"]


def test_exclusive_needs_the_whole_gpu_empty():
    node = entries(held("x", 0, 1000), held("y", 0, 1000), held("z", 1, 70000, priority=80))
    got = choose_victims(Need(gpus=1, memory_mib=MIB, cores=100), [gpu(0), gpu(1)], node, priority=50)
    assert isinstance(got, Victims) and sorted(got.claims) == ["x", "y"]


def test_cores_are_freed_as_well_as_memory():
    node = entries(held("sm", 0, 1000, cores=80), held("mem", 0, 70000, cores=10, priority=2))
    got = choose_victims(Need(gpus=1, memory_mib=1000, cores=50), [gpu(0)], node, priority=50)
    assert isinstance(got, Victims) and got.claims == ["sm"]


def test_only_the_gpus_the_claim_may_use():
    node = entries(held("a", 0, 80000), held("b", 1, 80000, ts=5.0))
    got = choose_victims(Need(gpus=1, memory_mib=80000), [gpu(0), gpu(1)], node, priority=50,
                         eligible={0})
    assert isinstance(got, Victims) and got.claims == ["a"]


def test_says_what_it_would_have_needed():
    node = entries(held("a", 0, 40000, priority=1), held("b", 0, 40000, priority=90))
    got = choose_victims(Need(gpus=1, memory_mib=80000), [gpu(0)], node, priority=50)
    assert isinstance(got, NoVictims)
    assert "b" in got.reason and "priority 90" in got.reason


def test_many_small_victims_when_that_is_what_it_takes():
    # Ten 8,000 MiB slices fill the GPU; 40,000 MiB needs five of them gone: the five lowest.
    node = entries(*(held(f"s{k}", 0, 8000, priority=k) for k in range(10)))
    got = choose_victims(Need(gpus=1, memory_mib=40000), [gpu(0)], node, priority=50)
    assert isinstance(got, Victims) and got.claims == ["s0", "s1", "s2", "s3", "s4"]
