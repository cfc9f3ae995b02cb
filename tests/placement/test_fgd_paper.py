"""The FGD paper's algorithm as a baseline (`fgd-paper`): its definitions on hand-made nodes."""

from tessera.placement.engine import Placement, Placer
from tessera.placement.fleet import Fleet
from tessera.placement.mix import Demand
from tessera.placement.paperfgd import PaperFGD, TypicalPods
from tessera.shared.events import GpuDevice, LedgerEntry, NodeInventory


def _node(name, gpus=4, cpu=32000, model="G2"):
    return NodeInventory(node=name, devices=[GpuDevice(uuid=f"{name}-{i}", index=i, model=model,
                                                       memory_mib=32768, max_shares=10) for i in range(gpus)],
                         cpu_millis=cpu, host_memory_mib=262144, ts=0.0)


def _share(pct, cpu=1000):
    return Demand(gpus=1, memory_percent=pct, cores=pct, cpu=cpu, hostmem=1024)


def _whole(k=1, cpu=1000, types=()):
    return Demand(gpus=k, cores=100, cpu=cpu, hostmem=1024, use_types=types)


def _commit(fleet, r, d, i):
    assert type(r) is Placement
    fleet.commit(r.node, LedgerEntry(claim=f"c{i}", tenant="t", shares=r.shares, cpu_millis=d.cpu,
                                     host_memory_mib=d.hostmem, ts=0.0))


def test_typical_pods_keep_the_most_popular_types_to_95_percent():
    ds = [_share(50)] * 60 + [_whole()] * 36 + [Demand(gpus=0, cpu=4000)] * 3 + [_whole(8)] * 1
    t = TypicalPods(ds)
    kinds = [(milli, gpus, round(p, 4)) for _, milli, gpus, _, p in t.types]
    # 60 + 36 = 96 >= 95: the two most popular, renormalised over what they cover.
    assert kinds == [(500, 1, round(60 / 96, 4)), (1000, 1, round(36 / 96, 4))]


def test_fragmentation_follows_the_papers_cases():
    fleet = Fleet()
    fleet.upsert_node(_node("a"))
    t = TypicalPods([_share(50)] * 1 + [_whole()] * 1 + [Demand(gpus=0, cpu=4000)] * 1 + [_whole(8)] * 1,
                    threshold=1.0)
    f = PaperFGD(t, fleet.states)
    acc = (True,) * 4
    # Four GPUs with 1000, 1000, 300 and 0 milli left, plenty of CPU.
    lefts = (1000, 1000, 300, 0)
    # CPU-only type: all 2300 idle; 8-GPU type cannot fit: all 2300; whole-GPU: the 300 sliver;
    # half-GPU: the 300 sliver too. Each type a quarter.
    assert abs(f.fragmentation(lefts, 32000, acc) - 0.25 * (2300 + 2300 + 300 + 300)) < 1e-9
    # Too little CPU for the GPU types (1000 each) leaves all idle capacity a fragment for them.
    assert abs(f.fragmentation(lefts, 500, acc) - 0.25 * (2300 * 4)) < 1e-9
    # A GPU model the half-GPU type excludes: all of it, for that type.
    half = [milli for _, milli, _, _, _ in t.types].index(500)
    acc = tuple(i != half for i in range(4))
    assert abs(f.fragmentation(lefts, 32000, acc) - 0.25 * (2300 + 2300 + 300 + 2300)) < 1e-9


def test_a_share_goes_where_it_closes_a_sliver_and_ties_go_to_the_first_node_by_name():
    fleet = Fleet()
    for name in ("n2", "n1", "n3"):
        fleet.upsert_node(_node(name))
    ds = [_share(50)] * 10 + [_whole()] * 10
    pl = Placer(fleet, "fgd-paper", typical=TypicalPods(ds), learn=False)
    d = _share(50)
    r = pl.place_demand(d)
    assert r.node == "n1"  # all three alike: the first by name
    _commit(fleet, r, d, 0)
    r2 = pl.place_demand(d)
    # The second half closes the first one's GPU (no sliver left) rather than opening a new GPU.
    assert r2.node == "n1" and [s.index for s in r2.shares] == [s.index for s in r.shares]


def test_same_filters_as_the_engine():
    fleet = Fleet()
    fleet.upsert_node(_node("t4", model="T4"))
    fleet.upsert_node(_node("small", cpu=500))
    pl = Placer(fleet, "fgd-paper", typical=TypicalPods([_whole()]), learn=False)
    r = pl.place_demand(_whole(types=("G2",)))
    assert type(r) is not Placement  # the G2 node lacks CPU, the other is a T4
    assert "gpu type" in r.reason and "CPU" in r.reason
