"""Rejection counts are kept up to date incrementally; they must equal a fresh count of the fleet."""

from fleetkit import Harness, inventory
from tessera.placement.engine import Placer, Rejection
from tessera.shared.events import ClaimSpec


def _fresh(h: Harness, **spec) -> Rejection:
    r = Placer(h.fleet, learn=False).place("probe", "team-a", ClaimSpec(**spec))
    assert isinstance(r, Rejection), r
    return r


def test_counts_follow_commits_releases_and_lost_nodes():
    nodes = [inventory(f"n{i}", gpus=2, memory_mib=40960, cpu_millis=8000) for i in range(4)]
    nodes += [inventory(f"t{i}", gpus=1, model="T4", memory_mib=16384) for i in range(2)]
    h = Harness(*nodes)
    big = dict(gpus=2, memory_mib=36000, cpu_millis=1500)
    placed = []
    rejected = 0
    for step in range(40):
        r = h.place(**big)
        if isinstance(r, Rejection):
            rejected += 1
            assert r.filtered == _fresh(h, **big).filtered
            assert r.reason == _fresh(h, **big).reason
        # Change the fleet between asks: commit slices, release some, lose and bring back a node.
        placed.append((h.claim(memory_mib=6000, cpu_millis=700, node_policy="spread", gpu_policy="spread"), h._n))
        if step % 5 == 4 and step < 30:
            p, n = placed.pop(0)
            h.fleet.release(p.node, f"c{n}")
        if step == 20:
            h.fleet.mark_lost("n1")
        if step == 30:
            h.fleet.upsert_node(nodes[1])
    assert rejected > 5
    r = h.place(gpus=2, memory_mib=39000)
    assert isinstance(r, Rejection)
    assert r.filtered == _fresh(h, gpus=2, memory_mib=39000).filtered
    assert sum(r.filtered.values()) == len(h.fleet.nodes)


def test_counts_survive_the_move_log_being_trimmed():
    nodes = [inventory(f"n{i}", gpus=1, memory_mib=40960) for i in range(4)]
    h = Harness(*nodes)
    spec = dict(memory_mib=50000)
    assert isinstance(h.place(**spec), Rejection)
    for _ in range(3000):  # enough commit/release churn to drop the front of the log
        p = h.claim(memory_mib=1000)
        h.fleet.release(p.node, f"c{h._n}")
    assert h.fleet.moves_base > 0
    r = h.place(**spec)
    assert r.filtered == _fresh(h, **spec).filtered == {"memory": 4}
