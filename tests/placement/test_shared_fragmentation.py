"""The fragmentation the fleet view shows (tessera.shared.fragmentation) is the engine's own number.

The engine computes a node's fragmentation on interned states and memo tables; the shared module
writes the same arithmetic plainly for the CLI. Here both measure the same nodes, after random
claims, under the same learned mix, with and without host memory's stranding term.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tessera.placement.engine import Placement, ledger_entry
from tessera.placement.mix import WorkloadMix
from tessera.shared import fragmentation
from tessera.shared.events import ClaimSpec, NodeLedger

from fleetkit import Harness, inventory


def random_spec(rng: random.Random) -> ClaimSpec:
    shape = rng.choice(["whole", "percent", "mib", "multi"])
    host = dict(cpu_millis=rng.choice([0, 2000, 8000]), host_memory_mib=rng.choice([0, 16384, 65536]))
    if shape == "whole":
        return ClaimSpec(gpus=1, cores=100, **host)
    if shape == "percent":
        p = rng.choice([10, 25, 50])
        return ClaimSpec(gpus=1, memory_percent=p, cores=p, **host)
    if shape == "mib":
        return ClaimSpec(gpus=1, memory_mib=rng.choice([4096, 10000, 20000]), cores=rng.choice([0, 20]), **host)
    return ClaimSpec(gpus=rng.choice([2, 4]), cores=100, **host)


@pytest.mark.parametrize("fluid", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_shared_definition_equals_the_engines(seed, fluid):
    rng = random.Random(seed)
    nodes = [inventory(f"n{i}", gpus=rng.choice([2, 4, 8]), memory_mib=rng.choice([16384, 81920]),
                       cpu_millis=rng.choice([16000, 64000]), host_memory_mib=rng.choice([65536, 262144]),
                       unhealthy=(0,) if rng.random() < 0.2 else ())
             for i in range(12)]
    seen = [random_spec(rng) for _ in range(60)]
    mix = WorkloadMix()
    mix.observe_all(seen)
    h = Harness(*nodes, mix=mix, fluid_memory=fluid, compiled=False)
    entries: dict[str, dict] = {n.node: {} for n in nodes}
    for i in range(40):
        spec = random_spec(rng)
        r = h.placer.place(f"c{i}", "team-a", spec)
        if isinstance(r, Placement):
            entry = ledger_entry(f"c{i}", "team-a", spec, r)
            h.fleet.commit(r.node, entry)
            entries[r.node][entry.claim] = entry
    kinds = fragmentation.mix_of(Counter(fragmentation.kind_of(s) for s in seen))
    measured = 0
    for inv in nodes:
        node = h.fleet.nodes[inv.node]
        engine = h.placer._frag(node.cls.devs, node.cpu_free, node.mem_free)
        ledger = NodeLedger(node=inv.node, entries=entries[inv.node])
        cpu_free, mem_free = fragmentation.host_free(inv, ledger)
        assert (cpu_free, mem_free) == (node.cpu_free, node.mem_free)
        shared = fragmentation.node_fragmentation(list(fragmentation.gpu_states(inv, ledger).values()),
                                                  cpu_free, mem_free, kinds, fluid_memory=fluid)
        assert shared == pytest.approx(engine, abs=1e-9), inv.node
        measured += engine > 0
    assert measured, "no node had any fragmentation: the comparison proved nothing"
