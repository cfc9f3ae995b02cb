"""The compiled fragmentation-aware core makes exactly the Python engine's decisions.

`_fgdcore.c` repeats the engine's scoring arithmetic in C on the same memo tables; the Python engine
is the reference. Two placers, one per core, are driven with the same claims and releases on
identical fleets, the mix learned as the service learns it, and must agree on every node, every
GPU and every score (bit for bit: the score is a float and it is compared with ==).
"""

from __future__ import annotations

import random

import pytest

from fleetkit import inventory
from tessera.shared.metrics import ServiceMetrics
from tessera.placement import engine
from tessera.placement.engine import Placement, Placer, ledger_entry
from tessera.placement.fleet import Fleet
from tessera.placement.mix import Demand
from tessera.shared.events import ClaimSpec

# Node types like openb's: GPU model and count, CPU millis, host memory MiB.
NODE_TYPES = (
    ("G2", 8, 96000, 786432), ("T4", 2, 32000, 131072), ("V100M16", 4, 64000, 262144),
    ("P100", 1, 32000, 131072), ("A10", 8, 128000, 393216), ("T4", 4, 96000, 262144),
)


def test_the_compiled_core_is_built():
    # make test installs services/placement, whose setup.py compiles it (gcc and the Python headers
    # are what it needs); without it the service runs, slower, on the Python engine.
    assert engine.COMPILED_CORE, "tessera.placement._fgdcore is not built: pip install -e services/placement"


def _fleet(rng: random.Random, nodes: int) -> Fleet:
    fleet = Fleet()
    for i in range(nodes):
        model, gpus, cpu, mem = rng.choice(NODE_TYPES)
        fleet.upsert_node(inventory(f"n{i:03d}", gpus=gpus, model=model, memory_mib=16384 if model != "G2" else 24576,
                                    cpu_millis=cpu, host_memory_mib=mem, unhealthy=(1,) if i % 37 == 5 else ()))
    return fleet


def _claim(rng: random.Random) -> ClaimSpec | Demand:
    cpu = rng.choice((2000, 4000, 8000, 16000, 32000))
    mem = rng.choice((4096, 16384, 32768, 65536, 131072))
    x = rng.random()
    if x < 0.40:
        pct = rng.randint(5, 95)
        spec = ClaimSpec(gpus=1, memory_percent=pct, cores=pct)
    elif x < 0.62:
        spec = ClaimSpec(gpus=1, cores=100, memory_percent=100)
    elif x < 0.72:
        spec = ClaimSpec(gpus=rng.choice((2, 4, 8)), cores=100, memory_percent=100)
    elif x < 0.78:
        spec = ClaimSpec(gpus=1, memory_mib=rng.choice((2048, 4096, 8192)), cores=rng.choice((10, 20, 30)))
    elif x < 0.84:  # a GPU-type selector
        spec = ClaimSpec(gpus=1, cores=50, memory_percent=50, use_types=[rng.choice(("T4", "V100"))])
    elif x < 0.90:  # another GPU policy under the fragmentation-aware node policy
        spec = ClaimSpec(gpus=1, cores=30, memory_percent=30, gpu_policy=rng.choice(("binpack", "spread")))
    else:  # a CPU-only task (what the packing benchmark places)
        return Demand(gpus=0, cpu=cpu, hostmem=mem)
    return ClaimSpec(**{**{f: getattr(spec, f) for f in spec.__struct_fields__}, "cpu_millis": cpu,
                        "host_memory_mib": mem})


def _drive(compiled: bool, seed: int, fluid: bool, nodes: int = 160, steps: int = 2500,
           warm: list | None = None) -> list:
    """With `warm`, indexes are also built ahead between claims (as the service does when idle),
    with budgets drawn from their own generator; `warm` collects what each call spent."""
    rng = random.Random(seed)
    wrng = random.Random(seed + 1000)
    fleet = _fleet(rng, nodes)
    placer = Placer(fleet, fluid_memory=fluid, compiled=compiled, seed=seed)
    live: list[tuple[str, str]] = []
    outcomes = []
    for i in range(steps):
        if warm is not None and wrng.random() < 0.5:
            warm.append(placer.warm(wrng.choice((1, 7, 40, 500))))
            if i % 25 == 0:
                _indexes_hold_the_live_classes(placer)
        if live and rng.random() < 0.3:  # a release: the node's class changes back
            node, cid = live.pop(rng.randrange(len(live)))
            fleet.release(node, cid)
            outcomes.append(("released", cid))
            continue
        what = _claim(rng)
        cid = f"c{i}"
        if isinstance(what, Demand):
            placer.mix.observe(what)
            r = placer.place_demand(what, explain=False)
            spec = ClaimSpec(gpus=0, cpu_millis=what.cpu, host_memory_mib=what.hostmem)
        else:
            r = placer.place(cid, "team-a", what)
            spec = what
        if isinstance(r, Placement):
            fleet.commit(r.node, ledger_entry(cid, "team-a", spec, r))
            live.append((r.node, cid))
            outcomes.append((r.node, tuple(s.uuid for s in r.shares), r.score))
        else:
            outcomes.append(("rejected", r.reason))
    return outcomes


@pytest.mark.parametrize("seed,fluid", [(1, True), (2, True), (3, False)])
def test_same_decisions_as_the_python_engine(seed, fluid):
    python = _drive(False, seed, fluid)
    compiled = _drive(True, seed, fluid)
    assert sum(1 for o in python if o[0] not in ("released", "rejected")) > 1000  # it did place a lot
    assert any(o[0] == "rejected" for o in python)  # and ran full
    for i, (a, b) in enumerate(zip(python, compiled)):
        assert a == b, f"step {i}: the Python engine decided {a}, the compiled core {b}"
    assert len(python) == len(compiled)


def _indexes_hold_the_live_classes(placer: Placer) -> None:
    """Every current shape index, brought up to date, holds one entry per live class that fits."""
    for ck, (_, _, d) in list(placer.index.heaps.items()):
        if ck[1] != placer._epoch:
            continue
        held = sorted((e for e in placer.index.get(ck, d, ck[3], ck[4]) if e[-2].alive), key=lambda e: e[-3])
        fresh = sorted(placer._entries(placer.fleet.classes.values(), ck, d, ck[3], ck[4]), key=lambda e: e[-3])
        assert held == fresh, f"shape {ck[2]}: its index does not hold the live classes' entries"


@pytest.mark.parametrize("compiled", [False, True])
def test_indexes_built_ahead_make_the_same_decisions(compiled):
    # After a republished mix, `warm` rebuilds the lately asked shapes' indexes a few classes at a
    # time, while claims and releases change the fleet in between; a claim may also come first and
    # finish an index begun ahead. Neither may change any decision.
    worked: list[int] = []
    warmed = _drive(compiled, 4, True, warm=worked)
    assert sum(1 for spent in worked if spent) > 20  # it did build indexes ahead, in several steps
    assert warmed == _drive(compiled, 4, True)


def test_the_service_setting_chooses_the_core():
    from tessera.placement.service import PlacementService, PlacementSettings
    from tessera.shared.settings import ConfigError
    from types import SimpleNamespace

    def core_of(value):
        settings = PlacementSettings.from_env({"TESSERA_PLACEMENT_CORE": value})
        return PlacementService(SimpleNamespace(bus=None, settings=SimpleNamespace(instance="", metrics_legacy=True),
                                               metrics=ServiceMetrics("placement")), settings).placer._core

    assert core_of("auto") is engine._core and core_of("compiled") is engine._core
    assert core_of("python") is None
    with pytest.raises(ConfigError, match="TESSERA_PLACEMENT_CORE"):
        PlacementSettings.from_env({"TESSERA_PLACEMENT_CORE": "fast"})
    assert PlacementSettings.from_env({"TESSERA_PLACEMENT_CORE": "compiled"}).core == "compiled"  # (built here)
