"""Why a claim fits nowhere: the rejection a caller sees, its reason and per-constraint counts.

Kept apart from the choice of node (`engine`): a rejection names, for every node, the first
constraint (in `CONSTRAINTS` order) it fails, and says so in a sentence. Counting is the only part
of a rejection that could cost a fleet scan, so the counts are kept per claim shape and brought up
to date from the fleet's log of nodes moving between classes (`Explainer.why_counts`), and a
rejection is remembered until the fleet changes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from .fleet import Fleet, Node, NodeClass
from .mix import Demand

__all__ = ["CONSTRAINTS", "Rejection", "UNEXPLAINED", "Explainer"]

# Order in which a node's failure is attributed to one constraint.
CONSTRAINTS = ("lost", "node-pin", "excluded", "cpu", "host-memory", "gpu-count", "gpu-type",
               "gpu-uuid", "exclusive", "max-shares", "memory", "cores")

# Per-GPU constraints in the order a rejection is attributed to them; 7 = fits.
_STEPS = ("gpu-count", "gpu-type", "gpu-uuid", "exclusive", "max-shares", "memory", "cores")

WHYS_CAP = 256  # claim shapes with live rejection counts
_CLASS_CAP = 64  # explained claim shapes per node class
_REJECTIONS_CAP = 256  # remembered rejections


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: str
    filtered: dict[str, int] = field(default_factory=dict)


UNEXPLAINED: Rejection = Rejection(reason="no node fits", filtered={})


def _fail_step(d: Demand, st) -> int:
    """Index in `_STEPS` of the first per-GPU constraint a GPU in state `st` fails for `d` (uuid
    selectors aside: they are per node), 7 if one more share fits."""
    if not st.healthy:
        return 0
    if not d.type_ok(st):
        return 1
    if st.exclusive or (d.exclusive and st.shares):
        return 3
    if st.shares >= st.max_shares:
        return 4
    if st.memory_mib - st.mem_used < d.mem_req(st.memory_mib):
        return 5
    if 100 - st.cores_used < d.cores:
        return 6
    return 7


def _n(x: int) -> str:
    return f"{x:,}"


class Explainer:
    """The rejections of one `Placer`'s fleet. `mask_of(node, d)` is the placer's uuid-selector mask
    of a node's GPUs (None where the claim has no uuid selectors)."""

    def __init__(self, fleet: Fleet, mask_of: Callable[[Node, Demand], list[bool] | None]) -> None:
        self.fleet = fleet
        self.mask_of = mask_of
        self._rejections: dict[tuple, tuple[int, Rejection]] = {}
        self._whys: OrderedDict[tuple, list] = OrderedDict()

    def explain(self, devs: tuple, cpu_free: int, mem_free: int, d: Demand, mask) -> str:
        """The first constraint (in `CONSTRAINTS` order) that leaves fewer than `d.gpus` GPUs."""
        if d.cpu > cpu_free:
            return "cpu"
        if d.hostmem > mem_free:
            return "host-memory"
        k = d.gpus
        if not k:
            return "fits"
        states = self.fleet.states.states
        fail = d._fail
        hist = [0] * 8
        for i, s in enumerate(devs):
            f = fail.get(s)
            if f is None:
                f = fail[s] = _fail_step(d, states[s])
            if mask is not None and f > 2 and not mask[i]:
                f = 2
            hist[f] += 1
        left = len(devs)
        for j in range(7):
            left -= hist[j]
            if left < k:
                return _STEPS[j]
        return "fits"

    def reject(self, d: Demand, ck: tuple | None, filtered: dict[str, int], nodes: list[Node] | None,
               exclude=frozenset()) -> Rejection:
        """The rejection of `d`: over the whole fleet (`nodes` None, counted per shape `ck` where
        given) or over `nodes`, with `filtered` the nodes the caller left out, per constraint."""
        if ck is not None and not exclude:
            hit = self._rejections.get(ck)
            if hit is not None and hit[0] == self.fleet.generation:
                return hit[1]
        r = self._counted(d, filtered, nodes, exclude)
        if ck is not None and not exclude:
            if len(self._rejections) > _REJECTIONS_CAP:
                self._rejections.clear()
            self._rejections[ck] = (self.fleet.generation, r)
        return r

    def _counted(self, d: Demand, filtered: dict[str, int], nodes: list[Node] | None,
                 exclude=frozenset()) -> Rejection:
        filtered = dict(filtered)
        if nodes is None:
            if self.fleet.lost:
                filtered["lost"] = len(self.fleet.lost)
            for why, n in self.why_counts(d).items():
                if n and not (exclude and why == "fits"):  # (fits but excluded: counted by the caller)
                    filtered[why] = filtered.get(why, 0) + n
        else:
            for node in nodes:
                cls = node.cls
                assert cls is not None
                why = self.explain(cls.devs, cls.cpu_free, cls.mem_free, d, self.mask_of(node, d))
                filtered[why] = filtered.get(why, 0) + 1
        filtered.pop("fits", None)
        return Rejection(reason=self.reason(d, filtered), filtered=filtered)

    def why_counts(self, d: Demand) -> dict[str, int]:
        """Live nodes per first failing constraint for this claim shape.

        Why a class rejects a shape depends on the class key alone, which never changes, so the
        counts are kept per shape and brought up to date from the fleet's log of nodes moving
        between classes: a rejection costs what moved since the shape was last rejected, not a
        fleet scan. A shape whose position fell off the log's front is recounted.
        """
        fleet = self.fleet
        moves = fleet.moves
        base = fleet.moves_base
        end = base + len(moves)
        wk = d.shape
        st = self._whys.get(wk)
        if st is None or st[1] < base:
            counts: dict[str, int] = {}
            for cls in fleet.classes.values():
                why = self.why(cls, wk, d)
                counts[why] = counts.get(why, 0) + len(cls.members)
            st = [counts, end]
            self._whys[d.shape] = st
            if len(self._whys) > WHYS_CAP:
                self._whys.popitem(last=False)
        else:
            self._whys.move_to_end(d.shape)
            if st[1] < end:
                # Net moves per class: a class born and emptied since then costs nothing.
                net: dict[NodeClass, int] = {}
                for cls, delta in moves[st[1] - base:]:
                    net[cls] = net.get(cls, 0) + delta
                counts = st[0]
                for cls, delta in net.items():
                    if delta:
                        why = self.why(cls, wk, d)
                        counts[why] = counts.get(why, 0) + delta
                st[1] = end
        return st[0]

    def why(self, cls: NodeClass, shape: tuple, d: Demand) -> str:
        whys = cls.whys
        why = whys.get(shape)
        if why is None:
            if len(whys) >= _CLASS_CAP:
                whys.clear()
            why = whys[shape] = self.explain(cls.devs, cls.cpu_free, cls.mem_free, d, None)
        return why

    def reason(self, d: Demand, filtered: dict[str, int]) -> str:
        if not self.fleet.nodes:
            return "no node fits: the fleet has no nodes"
        k = d.gpus
        g = f"{k} GPU" + ("s" if k != 1 else "")
        each = " each" if k > 1 else ""
        if d.memory_mib is not None:
            mem = f"{_n(d.memory_mib)} MiB"
        elif d.memory_percent is not None:
            mem = f"{d.memory_percent}% of memory"
        else:
            mem = "all memory"
        types = []
        if d.use_types:
            types.append("use: " + ", ".join(d.use_types))
        if d.nouse_types:
            types.append("nouse: " + ", ".join(d.nouse_types))
        text = {
            "lost": "{n} lost",
            "node-pin": f"{{n}} skipped (claim pinned to {d.node})",
            "excluded": "{n} excluded by the caller",
            "cpu": f"{{n}} lack {_n(d.cpu)} CPU millis free",
            "host-memory": f"{{n}} lack {_n(d.hostmem)} MiB host memory free",
            "gpu-count": f"{{n}} have fewer than {g} (healthy)",
            "gpu-type": f"{{n}} excluded by gpu type ({'; '.join(types)})",
            "gpu-uuid": "{n} excluded by gpu uuid selectors",
            "exclusive": (f"{{n}} lack {g} with no other share{each} (exclusive use)" if d.exclusive
                          else f"{{n}} lack {g} not held exclusively by another claim"),
            "max-shares": f"{{n}} lack {g} below their share limit",
            "memory": f"{{n}} lack {g} with {mem} free{each}",
            "cores": f"{{n}} lack {g} with {d.cores}% cores free{each}",
        }
        parts = []
        for name in sorted(filtered, key=lambda c: (-filtered[c], CONSTRAINTS.index(c))):
            n = filtered[name]
            parts.append(text[name].format(n=f"{_n(n)} node" + ("s" if n != 1 else "")))
        if d.node is not None and d.node not in self.fleet.nodes:
            parts.insert(0, f"pinned node {d.node} is unknown")
        return "no node fits: " + ", ".join(parts)
