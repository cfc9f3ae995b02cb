"""Between decisions the placement process rebuilds indexes ahead and runs the collector's passes.

What used to fall inside one claim's decision (a whole-fleet index per shape after the workload mix
was republished, a young-generation pass every 20,000 allocations) is done by `idlework.run` while
no claim waits; these tests pin what it does, not how fast.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from fleetkit import inventory
from kit import eventually
from tessera.placement import engine, idlework
from tessera.placement.engine import Placer
from tessera.placement.fleet import Fleet
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.events import ClaimSpec


@pytest.fixture
def collector():
    """The service's thresholds, a collector with nothing pending, and what each pass collected."""
    before = gc.get_threshold()
    gc.set_threshold(*idlework.GC_THRESHOLDS)
    gc.collect()
    passes: list[int] = []

    def seen(phase, info):
        if phase == "stop":
            passes.append(info["generation"])

    gc.callbacks.append(seen)
    yield passes
    gc.callbacks.remove(seen)
    gc.set_threshold(*before)


def test_no_pass_until_enough_has_built_up(collector):
    kept = [[] for _ in range(idlework.YOUNG_PASS_AT // 2)]
    assert not idlework.collect_if_due()
    assert collector == []
    assert kept


def test_young_passes_then_a_middle_one(collector):
    kept = []
    for _ in range(idlework.MIDDLE_PASS_EVERY):
        kept += [[] for _ in range(idlework.YOUNG_PASS_AT + 10)]
        assert idlework.collect_if_due()
        assert gc.get_count()[0] < 10  # the young generation was collected
    assert collector == [0] * (idlework.MIDDLE_PASS_EVERY - 1) + [1]


def _placer() -> Placer:
    fleet = Fleet()
    for i in range(12):
        fleet.upsert_node(inventory(f"n{i:02d}", gpus=2 + i % 3, cpu_millis=32000 + 8000 * (i % 4)))
    return Placer(fleet, fluid_memory=True, learn=False)


SHAPES = (ClaimSpec(gpus=1, cores=30, memory_percent=30, cpu_millis=4000, host_memory_mib=8192),
          ClaimSpec(gpus=2, cores=100, memory_percent=100, cpu_millis=16000, host_memory_mib=65536),
          ClaimSpec(gpus=1, cores=50, memory_percent=50, gpu_policy="binpack"))


def _current_indexes(placer: Placer) -> int:
    return sum(1 for ck in placer.index.heaps if ck[1] == placer._epoch)


async def test_indexes_are_rebuilt_ahead_after_the_mix_is_republished():
    placer = _placer()
    for spec in SHAPES:
        placer.place("x", "team-a", spec)
    assert _current_indexes(placer) == len(SHAPES)
    placer.mix.observe_all(placer.demand(s) for s in SHAPES)  # republished: every index is void
    gc.unfreeze()
    task = asyncio.create_task(idlework.run(placer, pause=0.001))
    try:
        await eventually(gc.get_freeze_count, every=0.005, what="the built indexes frozen out of the collector")
        assert placer._epoch == placer.mix.version
        assert _current_indexes(placer) == len(SHAPES)  # before any claim asked for them again
        assert not placer.warm()  # nothing left to do
        assert gc.get_freeze_count() > 0  # and the built indexes were taken out of the collector's walks
    finally:
        await cancel_and_wait([task])
        gc.unfreeze()


def test_an_index_begun_ahead_is_finished_by_the_claim_that_comes_first():
    placer, reference = _placer(), _placer()
    for p in (placer, reference):
        for spec in SHAPES:
            p.place("x", "team-a", spec)
        p.mix.observe_all(p.demand(s) for s in SHAPES)
    assert placer.warm(budget=3) == 3 and placer.index.warming  # a few classes of a shape, the rest to do
    for spec in SHAPES:
        a, b = placer.place("y", "team-a", spec), reference.place("y", "team-a", spec)
        assert (a.node, a.shares, a.score) == (b.node, b.shares, b.score)
    assert not placer.warm()


def _wide_placer(**kw) -> Placer:
    """A fleet of many distinct node classes (CPU sizes differ), so that scoring it is many
    evaluations."""
    fleet = Fleet()
    for i in range(120):
        fleet.upsert_node(inventory(f"w{i:03d}", gpus=2 + i % 3, cpu_millis=16000 + 1000 * i))
    return Placer(fleet, fluid_memory=True, learn=False, **kw)


def _count_evaluations(placer: Placer) -> list[int]:
    """Classes scored from now on, per call of the placer's entries (current and later indexes)."""
    counted: list[int] = []
    entries = placer._entries

    def counting(classes, *rest):
        classes = list(classes)
        counted.append(len(classes))
        return entries(classes, *rest)

    placer._entries = counting  # type: ignore[method-assign]  (what an index made later takes)
    placer.index.entries = counting
    return counted


def test_a_staged_mix_decides_on_the_indexes_before_it_until_its_own_are_built():
    placer, before, after = (_wide_placer(staged_mix=True), _wide_placer(), _wide_placer())
    for p in (placer, before, after):
        for spec in SHAPES:
            p.place("x", "team-a", spec)
    old = placer._epoch
    for p in (placer, after):
        p.mix.observe_all(p.demand(s) for s in SHAPES)  # republished ('before' keeps the old mix)
    counted = _count_evaluations(placer)
    # the claims right after the republish: the old mix's indexes decide, and each decision spends
    # a bounded step on the new mix's (not a score of the whole fleet per shape)
    for spec in SHAPES:
        a, b = placer.place("y", "team-a", spec), before.place("y", "team-a", spec)
        assert (a.node, a.shares, a.score) == (b.node, b.shares, b.score)
        assert placer._epoch == old
    assert 0 < sum(counted) <= len(SHAPES) * engine._STAGE_STEP
    while placer.warm():  # idle steps build the rest; the mix is taken up when they are done
        pass
    assert placer._epoch == placer.mix.version and _current_indexes(placer) == len(SHAPES)
    for p in (after,):
        for spec in SHAPES:
            p.place("y", "team-a", spec)
    counted.clear()
    for spec in SHAPES:  # now decided as by a placer that took the mix up at once
        a, b = placer.place("z", "team-a", spec), after.place("z", "team-a", spec)
        assert (a.node, a.shares, a.score) == (b.node, b.shares, b.score)
    assert sum(counted) <= len(SHAPES)  # (the log's classes born since, not the fleet)


def _retired(placer: Placer) -> int:
    """Entries of the retired tables (an index's: its heap's)."""
    return sum(sum(len(v[0]) + 1 for v in table.values()) if indexes else len(table)
               for table, indexes in placer._trash)


def test_what_a_republish_retired_is_freed_a_step_at_a_time():
    placer = _wide_placer()
    for spec in SHAPES:
        placer.place("x", "team-a", spec)
    placer.mix.observe_all(placer.demand(s) for s in SHAPES)
    assert placer.warm(budget=1) == 1  # the mix taken up: the old one's tables and indexes retired
    retired = _retired(placer)
    assert retired > engine._SWEEP
    steps = 0
    while placer.warm():
        left = _retired(placer)
        assert retired - left <= engine._SWEEP + 1  # (a heap's last entries and its key, one step)
        retired, steps = left, steps + 1
    assert not placer._trash and steps >= 2


async def test_no_step_is_taken_while_a_claim_is_being_handled():
    placer = _placer()
    for spec in SHAPES:
        placer.place("x", "team-a", spec)
    placer.mix.observe_all(placer.demand(s) for s in SHAPES)  # republished: indexes to build ahead
    quiet = asyncio.Event()  # (a claim is being handled)
    task = asyncio.create_task(idlework.run(placer, pause=0.001, quiet=quiet))
    try:
        for _ in range(20):
            await asyncio.sleep(0)
        assert placer._epoch != placer.mix.version  # nothing was done
        quiet.set()  # the claim is handled: the steps go on
        await eventually(lambda: placer._epoch == placer.mix.version and not placer.index.to_warm, every=0.005,
                         what="the indexes built once no claim was being handled")
    finally:
        await cancel_and_wait([task])
        gc.unfreeze()
