"""An unschedulable claim says which constraint failed on how many nodes, in words and numbers."""

from fleetkit import inventory
from tessera.placement.engine import Rejection


def test_counts_per_constraint_cover_every_node(harness):
    h = harness(
        inventory("h1", gpus=2, model="H100", memory_mib=81920),
        inventory("a1", gpus=2, model="A100", memory_mib=40960),
        inventory("a2", gpus=2, model="A100", memory_mib=40960),
        inventory("t1", gpus=1, model="T4", memory_mib=16384),
        inventory("c1", gpus=2, model="A100", cpu_millis=1000),
        inventory("lost", gpus=8, model="H100"),
    )
    h.fleet.mark_lost("lost")
    h.claim(cores=100, node="h1")
    r = h.place(gpus=2, memory_mib=41000, cpu_millis=2000, nouse_types=["t4"])
    assert isinstance(r, Rejection)
    assert r.filtered == {"lost": 1, "cpu": 1, "gpu-count": 1, "exclusive": 1, "memory": 2}
    assert r.reason.startswith("no node fits: 2 nodes lack 2 GPUs with 41,000 MiB free each, ")
    assert "1 node lost" in r.reason and "1 node lacks" not in r.reason


def test_reason_reads_like_a_sentence(harness):
    nodes = [inventory(f"n{i}", gpus=2, memory_mib=40960) for i in range(1204)]
    nodes += [inventory(f"h{i}", gpus=2, model="H100") for i in range(9)]
    h = harness(*nodes)
    r = h.place(gpus=2, memory_mib=40000, nouse_types=["h100"], cores=50)
    assert not isinstance(r, Rejection)
    r = h.place(gpus=2, memory_mib=41000, nouse_types=["H100"])
    assert isinstance(r, Rejection)
    assert r.filtered == {"memory": 1204, "gpu-type": 9}
    assert r.reason == ("no node fits: 1,204 nodes lack 2 GPUs with 41,000 MiB free each, "
                        "9 nodes excluded by gpu type (nouse: h100)")


def test_empty_fleet(harness):
    r = harness().place(memory_mib=1)
    assert isinstance(r, Rejection) and r.filtered == {} and "no nodes" in r.reason
