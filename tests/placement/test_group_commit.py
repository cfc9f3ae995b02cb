"""The service's group commit of ledger entries: what a failed or lost write does to the claims.

Driven with a ledger that fails on demand (the real one is raced by three processes in
tests/reliability): a lost compare-and-set is re-read and retried, an ordinary error becomes the
outcome of that node's claims only, and nothing queued is left waiting.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tessera.shared.metrics import ServiceMetrics
from tessera.placement.commit import Booking, Queued
from tessera.placement.service import PlacementService, PlacementSettings
from tessera.shared.errors import ConflictError
from tessera.shared.events import DeviceShare, LedgerEntry, NodeLedger

from fleetkit import inventory


class FlakyLedger:
    """write_nodes answers per node from a script: 'ok', 'conflict' or 'error'."""

    def __init__(self, script: dict[str, list[str]]) -> None:
        self.script = script
        self.rev = 0
        self.writes: list[str] = []

    async def write_nodes(self, items):
        out = []
        for ledger, _ in items:
            self.writes.append(ledger.node)
            steps = self.script.get(ledger.node)
            step = steps.pop(0) if steps else "ok"
            self.rev += 1
            if step == "conflict":
                out.append(ConflictError(f"ledger of {ledger.node} moved"))
            elif step == "error":
                out.append(OSError("connection lost"))
            else:
                out.append(self.rev)
        return out

    async def read_node(self, node):
        self.rev += 1
        return NodeLedger(node=node), self.rev


def service(script: dict[str, list[str]]) -> PlacementService:
    svc = PlacementService(SimpleNamespace(bus=None, settings=SimpleNamespace(instance="", metrics_legacy=True),
                                           metrics=ServiceMetrics("placement")), PlacementSettings())
    svc.ledger = FlakyLedger(script)
    for name in ("n1", "n2"):
        inv = inventory(name, gpus=2)
        svc.inventories[name] = inv
        svc.fleet.upsert_node(inv)
    return svc


def entry(claim: str, node: str) -> LedgerEntry:
    return LedgerEntry(claim=claim, tenant="t", shares=[DeviceShare(uuid=f"GPU-{node}-0", index=0, memory_mib=1000,
                                                                   cores=10)])


async def test_a_lost_write_is_retried_and_an_error_fails_only_that_nodes_claims():
    svc = service({"n1": ["conflict", "ok"], "n2": ["error"]})
    booked = [Booking("n1", entry("a", "n1")), Booking("n2", entry("b", "n2")), Booking("n1", entry("c", "n1"))]
    outcomes = await svc.committer.commit_booked(booked)
    assert outcomes[0] is None and outcomes[2] is None  # n1: lost once, re-read, written
    assert isinstance(outcomes[1], OSError)  # n2's claim carries the error; the batch goes on
    assert svc.counts["conflicts"] == 1
    assert set(svc.node_ledgers["n1"][0].entries) == {"a", "c"}
    assert not svc.committer.flushing and not svc.committer.queues


async def test_three_lost_writes_give_up_with_a_conflict():
    svc = service({"n1": ["conflict", "conflict", "conflict"]})
    [outcome] = await svc.committer.commit_booked([Booking("n1", entry("a", "n1"))])
    assert isinstance(outcome, ConflictError)
    assert not svc.committer.flushing


async def test_entries_queued_behind_a_flusher_that_fails_are_failed_not_left_waiting():
    svc = service({})

    async def broken(items):
        late = asyncio.get_running_loop().create_future()
        svc.committer.queues.setdefault("n1", []).append(Queued(entry("late", "n1"), late))  # queued meanwhile
        broken.late = late
        raise OSError("connection lost")

    svc.ledger.write_nodes = broken
    [outcome] = await svc.committer.commit_booked([Booking("n1", entry("a", "n1"))])
    assert isinstance(outcome, OSError)
    assert broken.late.done() and isinstance(broken.late.exception(), OSError)
    assert not svc.committer.flushing and not svc.committer.queues
