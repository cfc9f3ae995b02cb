"""What the placement process does between decisions, so that no claim's decision pays for it.

Two costs used to land inside a decision and make the latency tail (the p99 at 500 claims/s with
the default model; what they cost and what moving them bought are in bench/placement_sim.md):

- a republished workload mix voids every shape's index, and the next claim of each shape scored
  the whole fleet (dozens of shapes right after a republish): `Placer.warm` builds the indexes of
  the shapes asked for lately under the new mix, two classes per step, while decisions go on with
  the old mix's (the service's placer stages a republished mix, `staged_mix`), then frees what the
  old mix leaves, 32 entries per step;
- the cyclic garbage collector's passes: automatic every 20,000 tracked allocations, each long in
  the service (the engine's index entries and memo tables are young containers that survive, and
  every 20th pass walks hundreds of thousands of them again). They run here instead, in passes a tenth that
  size: what a pass walks is what was allocated since the one before, so the total is the same,
  cut into steps of a few milliseconds. The indexes rebuilt after a republish (tens of thousands
  of entries that live until the next one) are frozen out of the collector's walks once built
  (what is frozen is freed by its reference count as ever, but a cycle among it never would be:
  a freeze comes once per republish, and republishes grow rare as the mix's evidence grows).

One step is short (two class evaluations, 32 entries freed, or one young pass), and the task yields
to the event loop between steps: a claim that arrives meanwhile waits for one step at most. No step
is taken while the service handles a batch of claims (`quiet`): a claim awaiting its writes would
wait for a step at every reply. The automatic collector stays on as the backstop.
"""

from __future__ import annotations

import asyncio
import gc

from .engine import Placer

# Automatic collection thresholds set at start (the fleet is frozen out of the collector's walks).
GC_THRESHOLDS = (20_000, 20, 20)
YOUNG_PASS_AT = 2_000  # tracked allocations at which an idle step collects the young generation
MIDDLE_PASS_EVERY = 3  # young passes per middle-generation pass (the automatic one: 20)
# Middle passes per full pass: one per 8M allocations, the automatic cadence (20,000 x 20 x 20).
FULL_PASS_EVERY = GC_THRESHOLDS[0] * GC_THRESHOLDS[1] * GC_THRESHOLDS[2] // (YOUNG_PASS_AT * MIDDLE_PASS_EVERY)
PAUSE_SECONDS = 0.002  # between looks when there is nothing to do
# Class evaluations per step: on a cold memo one can take a fraction of a millisecond (eight took
# up to 4 ms on the 5,000-node fleet right after a republish), and a claim that arrives meanwhile
# waits for the step. Steps are not joined into longer ones: a step of half a millisecond of
# evaluations stalled the 500 claims/s stream for most of a second (bench/placement_sim.md).
WARM_BUDGET = 2


def settle_collector() -> None:
    """What is loaded at start (the fleet, imports) lives as long as the process: keep the cyclic
    collector from walking it again and again, and let it run less often between idle passes."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def collect_if_due() -> bool:
    """One young generation pass if enough has built up; every MIDDLE_PASS_EVERY one of the middle
    generation, every FULL_PASS_EVERY of those a full one (cyclic garbage that reached the old
    generation is freed there)."""
    young, middle, old = gc.get_count()
    if young < YOUNG_PASS_AT:
        return False
    if middle < MIDDLE_PASS_EVERY - 1:
        gc.collect(0)
    else:
        gc.collect(2 if old >= FULL_PASS_EVERY - 1 else 1)
    return True


async def run(placer: Placer, pause: float = PAUSE_SECONDS, quiet: asyncio.Event | None = None) -> None:
    """Forever: warm the placer's indexes, collect when due, yielding between steps. With `quiet`
    (set while no claim is being handled), a step waits for it: a claim awaiting its writes gets
    the loop back at each reply, and a step taken then would delay it once per round trip."""
    warming = False
    while True:
        if quiet is not None and not quiet.is_set():
            await quiet.wait()
        busy = bool(placer.warm(WARM_BUDGET))
        if busy:
            warming = True
        elif warming:  # a round of indexes is built: they live until the mix moves again
            warming = False
            gc.collect(0)
            gc.freeze()
            busy = True
        # (a young pass when due while warming too: building allocates, and a pass the collector
        # starts by itself lands in whatever runs next, a decision as often as not)
        if not collect_if_due() and not busy:
            await asyncio.sleep(pause)
            continue
        await asyncio.sleep(0)
