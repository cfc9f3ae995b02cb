"""The placement service's in-memory view of the fleet: which GPUs exist and how much of each is taken.

Placement has to answer in well under a millisecond on thousands of nodes, mostly in Python, so the
view is organised for that rather than for readability of a single node:

- every distinct per-GPU state (model, card memory, share limit, health, memory/cores/shares used,
  exclusive) is interned once as a small integer (`DeviceState`), so that a node's GPUs are a tuple
  of ints;
- nodes whose capacity and usage are identical (same GPU states, same CPU and host memory free)
  form one `NodeClass`; the engine scores a class once per claim shape and caches the result on the
  class. A commit or ledger update moves one node between classes, so the derived state is kept
  incrementally and scoring work is proportional to what changed, not to the fleet.

The ledger (JetStream KV, written by compare-and-set) is the source of truth; `apply_ledger` replaces
a node's usage with what a ledger record says. `commit` / `release` do the same bookkeeping locally
for the simulator and tests.
"""

from __future__ import annotations

from tessera.shared.events import GpuDevice, LedgerEntry, NodeInventory, NodeLedger

__all__ = ["DeviceState", "Fleet", "Node", "NodeClass", "DeviceStates"]


class DeviceState:
    """One interned per-GPU state. Immutable; identified by `id` (an index into `DeviceStates`)."""

    __slots__ = (
        "id", "model", "model_lc", "memory_mib", "max_shares", "healthy",
        "mem_used", "cores_used", "shares", "exclusive", "free", "used_score", "canon",
    )

    def __init__(self, sid: int, key: tuple) -> None:
        (model, memory_mib, max_shares, healthy, mem_used, cores_used, shares, exclusive) = key
        self.id = sid
        self.model = model
        self.model_lc = model.lower()
        self.memory_mib = memory_mib
        self.max_shares = max_shares
        self.healthy = healthy
        self.mem_used = mem_used
        self.cores_used = cores_used
        self.shares = shares
        self.exclusive = exclusive
        # The state itself, to order states by: ids follow the order states were first met in, which
        # differs between a placer that evaluates ahead and one that does not.
        self.canon = key
        # Unallocated capacity of this GPU in GPU units (the FGD paper's R_g): the smaller of free
        # memory and free compute. An exclusive holder owns the whole card; a sick card is no capacity.
        if not healthy or exclusive:
            self.free = 0.0
        else:
            self.free = max(0.0, min((memory_mib - mem_used) / memory_mib, (100 - cores_used) / 100))
        # HAMi's device score: used/total of shares, cores and memory.
        self.used_score = shares / max_shares + cores_used / 100 + mem_used / memory_mib


class DeviceStates:
    """Interning table of device states, shared by a fleet and the placers that read it."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}
        self.states: list[DeviceState] = []
        # (state id, memory MiB, cores) -> state id after one more share of that size.
        self._after: dict[tuple[int, int, int], int] = {}

    def intern(self, key: tuple) -> int:
        sid = self._ids.get(key)
        if sid is None:
            sid = len(self.states)
            self.states.append(DeviceState(sid, key))
            self._ids[key] = sid
        return sid

    def after(self, sid: int, memory_mib: int, cores: int) -> int:
        """The state of a GPU in state `sid` once a share of (memory, cores) is added to it."""
        k = (sid, memory_mib, cores)
        nid = self._after.get(k)
        if nid is None:
            s = self.states[sid]
            nid = self.intern((s.model, s.memory_mib, s.max_shares, s.healthy, s.mem_used + memory_mib,
                               s.cores_used + cores, s.shares + 1, s.exclusive or cores >= 100))
            self._after[k] = nid
        return nid

    def __len__(self) -> int:
        return len(self.states)


class _Device:
    """A physical GPU on a node with its live usage."""

    __slots__ = ("uuid", "index", "model", "memory_mib", "max_shares", "healthy",
                 "mem_used", "cores_used", "shares", "exclusive")

    def __init__(self, d: GpuDevice) -> None:
        self.uuid = d.uuid
        self.index = d.index
        self.model = d.model
        self.memory_mib = d.memory_mib
        self.max_shares = d.max_shares
        self.healthy = d.healthy
        self.mem_used = 0
        self.cores_used = 0
        self.shares = 0
        self.exclusive = False

    def key(self) -> tuple:
        return (self.model, self.memory_mib, self.max_shares, self.healthy,
                self.mem_used, self.cores_used, self.shares, self.exclusive)


class Node:
    """One node: static capacity, live usage, the ledger entries it holds and its class."""

    __slots__ = ("name", "labels", "cpu_millis", "host_memory_mib", "devices", "cpu_used", "mem_used",
                 "entries", "lost", "cls", "order", "by_uuid")

    def __init__(self, inv: NodeInventory) -> None:
        self.name = inv.node
        self.entries: dict[str, LedgerEntry] = {}
        self.lost = False
        self.cls: NodeClass | None = None
        self.order: tuple[int, ...] = ()
        self._load(inv)

    def _load(self, inv: NodeInventory) -> None:
        self.labels = dict(inv.labels)
        self.cpu_millis = inv.cpu_millis
        self.host_memory_mib = inv.host_memory_mib
        self.devices = [_Device(d) for d in sorted(inv.devices, key=lambda d: d.index)]
        self.by_uuid = {d.uuid: d for d in self.devices}
        self._recount()

    def _recount(self) -> None:
        for d in self.devices:
            d.mem_used = d.cores_used = d.shares = 0
            d.exclusive = False
        self.cpu_used = self.mem_used = 0
        for e in self.entries.values():
            self._add(e)

    def _device_for(self, share) -> _Device | None:
        d = self.by_uuid.get(share.uuid)
        if d is None and 0 <= share.index < len(self.devices) and not share.uuid:
            d = self.devices[share.index]
        return d

    def _add(self, e: LedgerEntry) -> None:
        self.cpu_used += e.cpu_millis
        self.mem_used += e.host_memory_mib
        for s in e.shares:
            d = self._device_for(s)
            if d is None:  # a ledger naming a GPU the inventory no longer has: nothing to take
                continue
            d.mem_used += s.memory_mib
            d.cores_used += s.cores
            d.shares += 1
            d.exclusive = d.exclusive or s.cores >= 100

    @property
    def cpu_free(self) -> int:
        return self.cpu_millis - self.cpu_used

    @property
    def mem_free(self) -> int:
        return self.host_memory_mib - self.mem_used


class NodeClass:
    """Nodes that are indistinguishable to placement: same GPU states, same CPU/host memory free.

    `devs` are the device state ids in sorted order; each member node's `order` maps those positions
    to its own device list. `cache` holds the engine's per-claim-shape result for this class, `whys` its rejection reasons.
    """

    __slots__ = ("id", "key", "devs", "cpu_total", "cpu_free", "mem_total", "mem_free", "members", "cache",
                 "whys", "alive")

    def __init__(self, cid: int, key: tuple) -> None:
        self.id = cid
        self.key = key
        self.cpu_total, self.cpu_free, self.mem_total, self.mem_free, self.devs = key
        self.members: dict[str, Node] = {}
        self.cache: dict = {}
        # Why a claim shape does not fit here, by shape: kept after the class dies, because the
        # engine's rejection counts still have to take its nodes off.
        self.whys: dict = {}
        self.alive = True

    def __lt__(self, other: NodeClass) -> bool:  # never reached in practice: ids are unique
        return self.id < other.id

    def first(self) -> Node:
        return next(iter(self.members.values()))


class Fleet:
    """The fleet as placement sees it. Not thread-safe; one event loop owns it."""

    def __init__(self) -> None:
        self.states = DeviceStates()
        self.nodes: dict[str, Node] = {}
        self.classes: dict[tuple, NodeClass] = {}
        self.lost: set[str] = set()
        self._next_class = 0
        # Ledger records that arrived before their node's inventory.
        self._pending: dict[str, NodeLedger] = {}
        # Bumped on every change; lets callers tell whether anything moved.
        self.generation = 0
        # Classes in creation (= id) order: a placer's per-shape index catches up from the last class
        # id it has seen instead of rescanning the fleet. Dead classes are pruned now and then.
        self.log: list[NodeClass] = []
        # Bumped when the set of live nodes changes (not on usage changes).
        self.roster_generation = 0
        # Every node joining (+1) or leaving (-1) a class, in order: a placer keeps per-shape counts
        # of why nodes are rejected up to date from here instead of rescanning the fleet. The front is
        # dropped now and then (`moves_base` counts what was dropped); a reader behind it recounts.
        self.moves: list[tuple[NodeClass, int]] = []
        self.moves_base = 0

    # --- inventory ------------------------------------------------------------------------------

    def upsert_node(self, inv: NodeInventory) -> None:
        node = self.nodes.get(inv.node)
        if node is None:
            node = Node(inv)
            self.nodes[inv.node] = node
        else:
            node._load(inv)
        node.lost = False
        self.lost.discard(inv.node)
        self.roster_generation += 1
        pending = self._pending.pop(inv.node, None)
        if pending is not None:
            node.entries = dict(pending.entries)
            node._recount()
        self._reclassify(node)

    def remove_node(self, node: str) -> None:
        n = self.nodes.pop(node, None)
        self.lost.discard(node)
        self._pending.pop(node, None)
        if n is not None:
            self._unclassify(n)
            self.generation += 1
            self.roster_generation += 1

    def mark_lost(self, node: str) -> None:
        n = self.nodes.get(node)
        if n is None or n.lost:
            return
        n.lost = True
        self.lost.add(node)
        self._unclassify(n)
        self.generation += 1
        self.roster_generation += 1

    # --- usage ----------------------------------------------------------------------------------

    def apply_ledger(self, ledger: NodeLedger) -> None:
        n = self.nodes.get(ledger.node)
        if n is None:
            self._pending[ledger.node] = ledger
            return
        n.entries = dict(ledger.entries)
        n._recount()
        self._reclassify(n)

    def commit(self, node: str, entry: LedgerEntry) -> None:
        n = self.nodes[node]
        replaced = entry.claim in n.entries
        n.entries[entry.claim] = entry
        if replaced:
            n._recount()
        else:
            n._add(entry)
        self._reclassify(n)

    def release(self, node: str, claim_id: str) -> None:
        n = self.nodes.get(node)
        if n is None:
            return
        if n.entries.pop(claim_id, None) is None:
            return
        n._recount()
        self._reclassify(n)

    # --- views ----------------------------------------------------------------------------------

    def node_count(self) -> int:
        return len(self.nodes)

    # --- classes --------------------------------------------------------------------------------

    def _unclassify(self, n: Node) -> None:
        cls = n.cls
        if cls is not None:
            del cls.members[n.name]
            self._moved(cls, -1)
            if not cls.members:
                del self.classes[cls.key]
                cls.alive = False
                cls.cache = {}
            n.cls = None

    def _reclassify(self, n: Node) -> None:
        self.generation += 1
        intern = self.states.intern
        ids = [intern(d.key()) for d in n.devices]
        order = sorted(range(len(ids)), key=ids.__getitem__)
        devs = tuple(ids[i] for i in order)
        key = (n.cpu_millis, n.cpu_millis - n.cpu_used, n.host_memory_mib, n.host_memory_mib - n.mem_used, devs)
        if n.cls is not None and n.cls.key == key and not n.lost:
            n.order = tuple(order)
            return
        self._unclassify(n)
        n.order = tuple(order)
        if n.lost:
            return
        cls = self.classes.get(key)
        if cls is None:
            cls = NodeClass(self._next_class, key)
            self._next_class += 1
            self.classes[key] = cls
            self.log.append(cls)
            if len(self.log) > 2 * len(self.classes) + 1024:
                self.log = [c for c in self.log if c.alive]
        cls.members[n.name] = n
        n.cls = cls
        self._moved(cls, 1)

    def _moved(self, cls: NodeClass, delta: int) -> None:
        moves = self.moves
        moves.append((cls, delta))
        if len(moves) > 8192 + 4 * len(self.nodes):
            drop = len(moves) // 2
            del moves[:drop]
            self.moves_base += drop
