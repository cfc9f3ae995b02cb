"""`tessera demo` counts the ledger entries left once a release has finished, not while it runs.

A claim's record says ``released`` before its ledger entry goes: the enforcer writes the record
first and removes the entry last (so that whoever finds the entry finishes a release stopped
midway), and placement gives back a lost race's entry after the record moved. The demo read the
ledger once, right after the last record said ``released``, and on a loaded machine found the last
entry still there (one run in about ten failed that way). Here the two steps of a release are played
on a real nats-server with the demo's count between them.
"""

from __future__ import annotations

import asyncio

from tessera.cli.client import Client
from tessera.cli.local import ledger_entries_left
from tessera.shared import subjects
from tessera.shared.claimstore import ClaimStore
from tessera.shared.events import ClaimRecord, ClaimSpec, DeviceShare, LedgerEntry, NodeLedger
from tessera.shared.ledger import Ledger

SHARE = DeviceShare(uuid="GPU-0", index=0, memory_mib=1000, cores=25)


async def _released_with_entry(bus, claim: str) -> Ledger:
    """``claim``'s record says released while its ledger entry on n1 is still there."""
    ledger = Ledger(await bus.kv(subjects.KV_LEDGER))
    entry = LedgerEntry(claim=claim, tenant="t", shares=[SHARE])
    await ledger.write_node(NodeLedger(node="n1", entries={claim: entry}), None)
    await ClaimStore(await bus.kv(subjects.KV_CLAIMS)).create(
        ClaimRecord(claim=claim, tenant="t", state="released", spec=ClaimSpec(gpus=1), node="n1", devices=[SHARE]))
    return ledger


async def test_an_entry_whose_release_is_under_way_is_not_counted_as_left(bus, nats_url):
    ledger = await _released_with_entry(bus, "c-1")
    client = await Client.connect(nats_url)
    try:
        counting = asyncio.create_task(ledger_entries_left(client))
        await asyncio.wait({counting}, timeout=1.0)
        assert not counting.done(), f"counted {counting.result()} left while the release was still under way"
        await ledger.release("n1", "c-1")  # the enforcer's last step
        assert await counting == 0
    finally:
        await client.close()


async def test_an_entry_that_stays_is_counted_as_left(bus, nats_url):
    await _released_with_entry(bus, "c-1")
    client = await Client.connect(nats_url)
    try:
        assert await ledger_entries_left(client, timeout=0.5) == 1
    finally:
        await client.close()
