"""The group commit: ledger entries decided here, written into the node ledgers by compare-and-set.

While one write to a node is in flight, entries for that node queue up and go out together in the
next write, so a hot node costs one round trip per batch rather than per claim, and this process's
own writes never conflict with each other. Every entry is checked against the ledger it is about to
overwrite (`tessera.shared.ledger.check_fit`), whatever the view said when it was decided: that
check, not the view, is what keeps a GPU from being over-committed by racing replicas. An entry for
a claim the view knows on another node's ledger is refused too (a redelivery or a peer's duplicate
that got past the placing lease, `tessera.placement.lease`), and so is an entry whose placing lease
has too little left to be written safely (`lease.live`).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

from tessera.shared.errors import ConflictError
from tessera.shared.events import LedgerEntry, NodeLedger
from tessera.shared.ledger import Ledger, check_fit

from tessera.placement import lease
from tessera.placement.view import FleetView

# A node whose ledger a peer keeps moving is re-read and written again this many times per drain.
NODE_ATTEMPTS = 3


@dataclass(frozen=True)
class Booking:
    """An entry already booked in the view, to be written into ``node``'s ledger."""

    node: str
    entry: LedgerEntry
    leased_until: float | None = None  # the claim's placing lease (None: none to honour)


@dataclass(frozen=True)
class Queued:
    entry: LedgerEntry
    done: asyncio.Future
    leased_until: float | None = None


@dataclass(frozen=True)
class NodeWrite:
    """One pass's write of one node: the entries that fit (``accepted``) and why the others did not."""

    node: str
    batch: list[Queued]
    ledger: NodeLedger
    revision: int | None
    accepted: list[asyncio.Future]
    refused: list[tuple[asyncio.Future, str]]


class GroupCommit:
    def __init__(self, view: FleetView, counts: Counter | dict) -> None:
        self.view = view
        self.counts = counts
        self.ledger: Ledger  # set once the bucket is open
        self.queues: dict[str, list[Queued]] = {}
        self.flushing: set[str] = set()

    async def commit(self, node: str, entry: LedgerEntry, leased_until: float | None = None) -> None:
        """Book ``entry`` in the view and write it into the node's ledger; ConflictError if it no
        longer fits there (or the ledger kept moving, or its lease ran out), the write's own error
        if it failed."""
        self.view.book(node, entry)
        done = asyncio.get_running_loop().create_future()
        self.queues.setdefault(node, []).append(Queued(entry, done, leased_until))
        try:
            if node not in self.flushing:
                await self.drain([node])
            await done
        except BaseException:
            self.view.unbook(node, entry.claim)
            self.view.restore(node)
            raise
        self.view.unbook(node, entry.claim)

    async def commit_booked(self, booked: list[Booking]) -> list[BaseException | None]:
        """Group-commit entries already booked in the view: one ledger write per node."""
        loop = asyncio.get_running_loop()
        futures = []
        for b in booked:
            done = loop.create_future()
            self.queues.setdefault(b.node, []).append(Queued(b.entry, done, b.leased_until))
            futures.append(done)
        # Nodes another coroutine is flushing: its flusher takes our entries too.
        await self.drain([n for n in dict.fromkeys(b.node for b in booked) if n not in self.flushing])
        results = await asyncio.gather(*futures, return_exceptions=True)
        touched = set()
        out: list[BaseException | None] = []
        for b, result in zip(booked, results):
            self.view.unbook(b.node, b.entry.claim)
            if isinstance(result, BaseException):
                touched.add(b.node)
                out.append(result if isinstance(result, Exception) else ConflictError(str(result)))
            else:
                out.append(None)
        for node in touched:  # undo the local booking of what did not make it into the ledger
            self.view.restore(node)
        return out

    def _plan(self, node: str, batch: list[Queued]) -> NodeWrite:
        ledger, revision = self.view.ledger_of(node)
        inventory = self.view.inventories.get(node)
        entries = dict(ledger.entries)
        accepted: list[asyncio.Future] = []
        refused: list[tuple[asyncio.Future, str]] = []
        now = time.time()
        for q in batch:
            candidate = NodeLedger(node=node, entries=entries)
            elsewhere = self.view.claim_nodes.get(q.entry.claim, node)
            why: str | None
            if elsewhere != node:  # never a second node's entry for one claim, not even for a revision
                why = f"already placed on {elsewhere}"
            elif not lease.live(q.leased_until, now):  # a peer may hold the claim by now
                why = "its placing lease ran out before the write"
            elif inventory is None:
                why = "node left the fleet"
            else:
                why = check_fit(inventory.devices, candidate, q.entry)
            if why is None:
                entries[q.entry.claim] = q.entry
                accepted.append(q.done)
            else:
                refused.append((q.done, f"{q.entry.claim} no longer fits on {node}: {why}"))
        return NodeWrite(node, batch, NodeLedger(node=node, entries=entries), revision, accepted, refused)

    async def drain(self, nodes: list[str]) -> None:
        """Write the entries queued for ``nodes`` into their ledgers until no more are queued.

        Each pass checks every queued entry still fits on its node and sends one compare-and-set
        write per node, all pipelined; a node whose ledger moved (a peer wrote it) is re-read and
        tried again, up to NODE_ATTEMPTS times. Entries queued meanwhile by other coroutines go out
        in the next pass, so our own writes to one node never race each other.
        """
        self.flushing.update(nodes)
        attempts: dict[str, int] = {}
        work = {n: self.queues.pop(n) for n in nodes if self.queues.get(n)}
        try:
            while work:
                writes = [self._plan(node, batch) for node, batch in work.items()]
                sent = [w for w in writes if w.accepted]
                results = await self.ledger.write_nodes([(w.ledger, w.revision) for w in sent]) if sent else []
                outcome = dict(zip((w.node for w in sent), results))
                retry: dict[str, list[Queued]] = {}
                for w in writes:
                    result = outcome.get(w.node, w.revision)
                    if isinstance(result, ConflictError):
                        self.counts["conflicts"] += 1
                        attempts[w.node] = attempts.get(w.node, 0) + 1
                        if attempts[w.node] < NODE_ATTEMPTS:
                            ledger, at = await self.ledger.read_node(w.node)
                            self.view.remember(w.node, ledger, at)
                            retry[w.node] = w.batch
                            continue
                    if isinstance(result, Exception):
                        for q in w.batch:
                            if not q.done.done():
                                q.done.set_exception(result)
                        continue
                    if w.accepted:
                        self.view.remember(w.node, w.ledger, result)
                    for done in w.accepted:
                        if not done.done():
                            done.set_result(None)
                    for done, why in w.refused:
                        if not done.done():
                            done.set_exception(ConflictError(why))
                for node in nodes:  # what others queued for our nodes while we wrote
                    queued = self.queues.pop(node, None)
                    if queued:
                        retry[node] = retry.get(node, []) + queued
                work = retry
        except BaseException as exc:
            # Everything still waiting on these nodes fails with it, also what others queued since
            # (no flusher is left to take it); an ordinary error is the claims' outcome, not ours.
            error = exc if isinstance(exc, Exception) else ConflictError(str(exc))
            for node in nodes:
                for q in work.get(node, []) + self.queues.pop(node, []):
                    if not q.done.done():
                        q.done.set_exception(error)
            if not isinstance(exc, Exception):
                raise
        finally:
            self.flushing.difference_update(nodes)
