"""Placement's view of the fleet: what the ``inventory``, ``ledger`` and ``tenants`` watchers maintain.

Decisions are made in memory against this view, and the ledger's compare-and-set is what keeps a
stale view from over-committing. The view also holds this process's *tentative* bookings (entries
decided but not yet in the ledger), so that concurrent decisions here see them; a booking that does
not make it into the ledger is undone with `restore`.

It also holds the room promised to preempting claims (their `Nomination`s, read from their claim
records and ``unschedulable`` events, so rebuilt by any replica after a restart): a victim's entry,
once gone from the ledger, still counts here until its preemptor is placed, for every decision but
the preemptor's own and those of claims of higher priority (`unheld`). One malformed value in a watched bucket is
logged, counted and skipped (`tessera.shared.kv.Codec`): it must not stop the view from following.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tessera.shared import subjects
from tessera.shared.events import GpuQuota, LedgerEntry, NodeInventory, NodeLedger, Nomination, TenantRecord
from tessera.shared.inventory import is_lost
from tessera.shared.kv import Codec

from tessera.placement.fleet import Fleet

_inventories: Codec[NodeInventory] = Codec(NodeInventory, subjects.KV_INVENTORY)
_tenants: Codec[TenantRecord] = Codec(TenantRecord, subjects.KV_TENANTS)
_node_ledgers: Codec[NodeLedger] = Codec(NodeLedger, subjects.KV_LEDGER)

_GONE = ("DEL", "PURGE")


class FleetView:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.inventories: dict[str, NodeInventory] = {}
        # node -> (ledger as last read or written, its revision)
        self.node_ledgers: dict[str, tuple[NodeLedger, int | None]] = {}
        self.claim_nodes: dict[str, str] = {}  # claim -> the node whose ledger holds it
        # Kubernetes mode: pod uid -> the node its claim's ledger entry (or booking) is on, so that
        # a pod placed and not yet bound counts on that node (`tessera.placement.clusternodes`).
        self.pod_nodes: dict[str, str] = {}
        self.quotas: dict[str, GpuQuota] = {}
        self.tenant_records: dict[str, TenantRecord] = {}  # (their borrowing limits and weights)
        self.tenants_known: set[str] = set()
        self.tentative: dict[str, dict[str, LedgerEntry]] = {}  # node -> claim -> entry in flight
        # tenant -> its ``tenant.<tenant>`` ledger value, undecoded: only the metrics read it
        # (HAMi's quota series), so the watch pays a dict write, not a decode.
        self.tenant_usage: dict[str, bytes] = {}
        self.nominations: dict[str, Nomination] = {}  # waiting preemptor -> where its victims' room is held
        self._unheld: frozenset[str] = frozenset()  # nominations not counted in the decision being made

    # --- the watchers: each returns whether a waiting claim might fit now ---------------------

    def on_inventory(self, key: str, value: bytes | None, revision: int, op) -> bool:
        if op in _GONE or not value:
            self.inventories.pop(key, None)
            self.fleet.remove_node(key)
            return True
        inv = _inventories.decode_or_skip(key, value)
        if inv is None:
            return False
        self.inventories[inv.node] = inv
        self.fleet.upsert_node(inv)
        if is_lost(inv):
            self.fleet.mark_lost(inv.node)
        if inv.node in self.node_ledgers:
            self.restore(inv.node)
        return True

    def on_ledger(self, key: str, value: bytes | None, revision: int, op) -> bool:
        if not key.startswith("node."):
            if not key.startswith("tenant."):
                return False
            if op in _GONE or not value:
                self.tenant_usage.pop(key[7:], None)
            else:
                self.tenant_usage[key[7:]] = value
            return True  # quota returned: a claim waiting on it may fit
        node = key[5:]
        known = self.node_ledgers.get(node)
        if known is not None and known[1] is not None and known[1] >= revision:
            return False  # our own write, already applied: skip decoding it
        if op in _GONE or not value:
            ledger = NodeLedger(node=node)
        else:
            decoded = _node_ledgers.decode_or_skip(key, value)
            if decoded is None:
                return False  # keep what we knew; a commit to this node re-reads (and refuses) it
            ledger = decoded
        released = known is not None and any(c not in ledger.entries for c in known[0].entries)
        self.remember(node, ledger, revision)
        return released

    def on_tenant(self, key: str, value: bytes | None, revision: int, op) -> bool:
        if op in _GONE or not value:
            self.quotas.pop(key, None)
            self.tenant_records.pop(key, None)
            self.tenants_known.discard(key)
            return True
        record = _tenants.decode_or_skip(key, value)
        if record is None:
            return False
        self.quotas[record.tenant] = record.quota
        self.tenant_records[record.tenant] = record
        self.tenants_known.add(record.tenant)
        return True

    # --- what the commit path tells it -------------------------------------------------------

    def remember(self, node: str, ledger: NodeLedger, revision: int | None) -> None:
        """``ledger`` is the node's ledger at ``revision`` (read or written by us)."""
        old = self.node_ledgers.get(node)
        if old is not None:
            for claim, entry in old[0].entries.items():
                if claim not in ledger.entries and self.claim_nodes.get(claim) == node:
                    del self.claim_nodes[claim]
                if entry.pod_uid and claim not in ledger.entries and self.pod_nodes.get(entry.pod_uid) == node:
                    del self.pod_nodes[entry.pod_uid]
        for claim, entry in ledger.entries.items():
            self.claim_nodes[claim] = node
            if entry.pod_uid:
                self.pod_nodes[entry.pod_uid] = node
            if claim in self.nominations:  # the preemptor placed: nothing more to hold for it
                del self.nominations[claim]
        self.node_ledgers[node] = (ledger, revision)
        self.apply_to_fleet(node, ledger)

    def ledger_of(self, node: str) -> tuple[NodeLedger, int | None]:
        return self.node_ledgers.get(node, (NodeLedger(node=node), None))

    # --- nominations: the room preempting claims' victims free, held for them ----------------

    def nominate(self, claim: str, nomination: Nomination | None) -> None:
        """``claim`` waits for ``nomination``'s victims (None: for none any more)."""
        old = self.nominations.pop(claim, None)
        if nomination is not None and claim not in self.claim_nodes:
            self.nominations[claim] = nomination
        if old != self.nominations.get(claim):
            for node in {n.node for n in (old, nomination) if n is not None}:
                self.restore(node)

    def victims_taken(self, claim: str) -> set[str]:
        """The claims already preempted for others than ``claim``: never chosen again."""
        return {v.claim for c, n in self.nominations.items() if c != claim for v in n.victims}

    def held_for_others(self, node: str, claim: str, priority: int) -> dict[str, LedgerEntry]:
        """The entries of victims gone from ``node``'s ledger whose room is held for a preemptor
        other than ``claim`` of no lower priority than ``priority``: they count for ``claim``."""
        ledger = self.ledger_of(node)[0].entries
        return {v.claim: v for c, n in self.nominations.items()
                if n.node == node and c != claim and (n.priority >= priority or n.reclaim)
                for v in n.victims if v.claim not in ledger}

    @contextlib.contextmanager
    def unheld(self, claim: str, priority: int) -> Iterator[None]:
        """Within: the fleet without the room held for ``claim`` itself or for claims of lower
        priority than ``priority`` (kube-scheduler's rule for nominated pods); the room reclaimed
        for a tenant's guarantee stays held whatever the priority."""
        skip = frozenset(c for c, n in self.nominations.items()
                         if c == claim or (n.priority < priority and not n.reclaim))
        if not skip:
            yield
            return
        nodes = {self.nominations[c].node for c in skip}
        self._unheld = skip
        try:
            for node in nodes:
                self.restore(node)
            yield
        finally:
            self._unheld = frozenset()
            for node in nodes:
                self.restore(node)

    def _held(self, node: str, ledger: NodeLedger) -> dict[str, LedgerEntry]:
        return {v.claim: v for c, n in self.nominations.items() if n.node == node and c not in self._unheld
                for v in n.victims if v.claim not in ledger.entries}

    def book(self, node: str, entry: LedgerEntry) -> None:
        """Count ``entry`` on ``node`` in decisions made here before the ledger holds it."""
        self.fleet.commit(node, entry)
        self.tentative.setdefault(node, {})[entry.claim] = entry
        if entry.pod_uid:
            self.pod_nodes[entry.pod_uid] = node

    def unbook(self, node: str, claim: str) -> None:
        self.tentative.get(node, {}).pop(claim, None)

    def unbook_all(self, claims: set[str]) -> None:
        """Undo the bookings of ``claims`` that never reached the ledger."""
        for node, booked in self.tentative.items():
            if claims & booked.keys():
                for claim in claims & booked.keys():
                    pod = booked.pop(claim).pod_uid
                    if pod and self.pod_nodes.get(pod) == node and claim not in self.ledger_of(node)[0].entries:
                        del self.pod_nodes[pod]
                self.restore(node)

    def restore(self, node: str) -> None:
        """Show the node as its ledger (plus what is still booked here) says."""
        self.apply_to_fleet(node, self.ledger_of(node)[0])

    def apply_to_fleet(self, node: str, ledger: NodeLedger) -> None:
        if node not in self.inventories:
            return
        extra = self.tentative.get(node)
        promised = self._held(node, ledger) if self.nominations else None
        if extra or promised:
            entries = dict(ledger.entries)
            entries.update(promised or {})
            entries.update(extra or {})
            ledger = NodeLedger(node=node, entries=entries)
        held = self.fleet.nodes.get(node)
        if held is not None and held.entries == ledger.entries:
            return  # (our own write coming back: the view already holds it)
        self.fleet.apply_ledger(ledger)
