"""The per-shape index: for each claim shape, a heap of the node classes it fits, best first.

A claim shape is scored against a node class once: the heap of a shape is built over the fleet's
classes when the shape is first asked for (or ahead of it, a few classes at a time, by `warm`
after a republished mix voided every index), then brought up to date from the fleet's class log,
evaluating only the classes born since; dead classes are dropped lazily. What an entry holds and
how it is scored is the engine's business (`entries`, the placer's scorer); this module keeps the
heaps, their order of use, and the work left to do ahead.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from heapq import heapify, heappop, heappush
from operator import attrgetter
from typing import Callable

from .fleet import Fleet
from .mix import Demand

__all__ = ["ShapeIndex", "HEAPS_CAP"]

HEAPS_CAP = 256  # claim shapes with a live index
_class_id = attrgetter("id")

# entries(classes, shape key, demand, node policy, gpu policy) -> the classes' entries, unordered:
# (score..., class id, class, positions) for each class that can host the demand.
Entries = Callable[[object, tuple, Demand, str, str], list]


class ShapeIndex:
    def __init__(self, fleet: Fleet, entries: Entries) -> None:
        self.fleet = fleet
        self.entries = entries
        # shape key -> [heap, last class id seen, demand], least recently used first
        self.heaps: OrderedDict[tuple, list] = OrderedDict()
        self.warming: dict[tuple, list] = {}  # shape key -> [entries so far, last class, classes left]
        self.to_warm: list[tuple[Demand, str, str]] = []  # shapes to index ahead (`warm`)

    def get(self, ck: tuple, d: Demand, node_policy: str, gpu_policy: str) -> list:
        """The heap of (score..., class id, class, positions) over the live classes that fit `d`.

        Its top is the least entry of the live classes whatever order they were evaluated in (class
        ids are unique), so a warmed index decides as one built at once.
        """
        fleet = self.fleet
        log = fleet.log
        last = fleet._next_class - 1
        idx = self.heaps.get(ck)
        if idx is None:
            part = self.warming.pop(ck, None)
            if part is None:  # (classes are born in id order: up to `last`, the log adds nothing)
                heap = self.entries(fleet.classes.values(), ck, d, node_policy, gpu_policy)
                built = last
            else:  # begun ahead of this claim (`warm`): the rest of its classes, then the log's news
                heap, built, todo = part[0], part[1], part[2]
                heap += self.entries([c for c in todo if c.alive], ck, d, node_policy, gpu_policy)
            heapify(heap)
            idx = [heap, built, d]
            self.heaps[ck] = idx
            if len(self.heaps) > HEAPS_CAP:
                self.heaps.popitem(last=False)
        else:
            self.heaps.move_to_end(ck)
        heap = idx[0]
        if idx[1] < last:
            fresh = [cls for cls in log[bisect_right(log, idx[1], key=_class_id):] if cls.alive]
            for e in self.entries(fresh, ck, d, node_policy, gpu_policy):
                heappush(heap, e)
            idx[1] = last
        while heap and not heap[0][-2].alive:
            heappop(heap)
        if len(heap) > 2 * len(fleet.classes) + 64:
            heap = [e for e in heap if e[-2].alive]
            heapify(heap)
            idx[0] = heap
        return heap

    def recent(self, keep: Callable[[tuple], bool], shapes: int = HEAPS_CAP) -> list[tuple[Demand, str, str]]:
        """The last `shapes` used whose key passes `keep`, as (demand, node policy, GPU policy), the
        most recent last (what another index is to build ahead, by `warm`)."""
        return [(idx[2], ck[3], ck[4]) for ck, idx in list(self.heaps.items())[-shapes:] if keep(ck)]

    def retire(self, keep: Callable[[tuple], bool], shapes: int = HEAPS_CAP) -> OrderedDict:
        """Void every index (a republished mix); the last `shapes` used whose key passes `keep` are
        to be indexed again ahead (`warm`), the most recent first. Returns the old heaps (to free)."""
        old = self.heaps
        self.to_warm = self.recent(keep, shapes)
        self.warming = {}
        self.heaps = OrderedDict()
        return old

    def warm(self, budget: int, key_of: Callable[[Demand, str, str], tuple]) -> int:
        """Spend up to `budget` class evaluations on the shapes left to index ahead; `key_of` is
        the current shape key of (demand, node policy, GPU policy). Returns the evaluations spent."""
        spent = 0
        todo = self.to_warm
        while todo and budget > 0:
            d, node_policy, gpu_policy = todo[-1]
            ck = key_of(d, node_policy, gpu_policy)
            if ck in self.heaps:
                todo.pop()
                continue
            part = self.warming.get(ck)
            if part is None:
                part = self.warming[ck] = [[], self.fleet._next_class - 1, list(self.fleet.classes.values())]
            heap, _, left = part
            take = left[-budget:]
            del left[-budget:]
            heap += self.entries([c for c in take if c.alive], ck, d, node_policy, gpu_policy)
            budget -= len(take)
            spent += len(take)
            if not left:
                self.get(ck, d, node_policy, gpu_policy)  # (files it, catches up with the log)
                todo.pop()
        return spent
