"""No ledger revision may hold one claim on two nodes (issue 12, the fault suite's "duplicated").

Two replicas that both retry one waiting claim (every replica follows every ``unschedulable``), or a
redelivery racing the first delivery, decided it each on its own node and wrote both ledgers; the
claim record's compare-and-set then let one win and the loser rolled its entry back. The end state
was right, but for the revisions between, the claim held capacity twice. The race is made
deterministic here: both replicas are held at the commit until both got there (or one was refused).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from functools import partial

import msgspec
import pytest

from tessera.placement import lease
from tessera.shared import subjects
from tessera.shared.bus import Delivery
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.errors import ConflictError
from tessera.shared.events import DeviceShare, LedgerEntry, NodeLedger

from kit import eventually
from placementkit import replicas, requested, tenant


async def _watch_ledger(kv, revisions: list[dict[str, set[str]]]) -> None:
    """Every revision of the ledger bucket, as node -> claims after it."""
    held: dict[str, set[str]] = {}
    watcher = await kv.watchall()
    try:
        async for entry in watcher:
            if entry is None or not entry.key.startswith("node."):
                continue
            node = entry.key[5:]
            ledger = msgspec.json.decode(entry.value, type=NodeLedger) if entry.value else NodeLedger(node=node)
            held[node] = set(ledger.entries)
            revisions.append({n: set(c) for n, c in held.items()})
    finally:
        await watcher.stop()


async def test_two_replicas_retrying_one_claim_never_hold_it_on_two_nodes(nats_url):
    async with replicas(nats_url, 2) as [a, b]:
        await tenant(a.svc.bus, "a")
        await eventually(lambda: _known(a.svc, b.svc, "a"))
        event = await requested(a.svc.bus, "c")
        # Both replicas hold the claim as waiting (as after an ``unschedulable``), and each would
        # put it on its own node.
        for replica, other in ((a, "n2"), (b, "n1")):
            replica.svc.pending["c"] = msgspec.structs.replace(event, record_revision=0)
            replica.svc.placer.place = partial(replica.svc.placer.place, exclude_nodes=(other,))
        both_there = asyncio.Barrier(2)
        for replica in (a, b):
            real = replica.svc._commit

            async def held(node, entry, *lease, real=real):
                try:
                    await asyncio.wait_for(both_there.wait(), 1.0)
                except TimeoutError:  # the other was refused before committing: go alone
                    pass
                await real(node, entry, *lease)

            replica.svc._commit = held
        revisions: list[dict[str, set[str]]] = []
        watch = asyncio.create_task(_watch_ledger(await a.svc.bus.kv(subjects.KV_LEDGER), revisions))
        try:
            outcomes = await asyncio.gather(a.svc.place(a.svc.pending["c"]), b.svc.place(b.svc.pending["c"]),
                                            return_exceptions=True)
            record = (await a.svc.claims.get("c"))[0]
            assert record.state == "allocated"
            await eventually(lambda: _seen(revisions, record.node))
        finally:
            await cancel_and_wait([watch])
        doubled = [r for r in revisions if sum("c" in claims for claims in r.values()) > 1]
        assert not doubled, f"ledger revisions holding c on two nodes: {doubled}"
        assert sum(o is True for o in outcomes) == 1, outcomes


async def _known(a, b, name) -> bool:
    return name in a.tenants_known and name in b.tenants_known


async def _seen(revisions, node) -> bool:
    return bool(revisions) and "c" in revisions[-1].get(node, set())


async def test_a_live_lease_of_a_peer_keeps_the_claim_from_this_replica_until_it_runs_out(nats_url):
    async with replicas(nats_url, 2) as [a, b]:
        await tenant(a.svc.bus, "a")
        await eventually(lambda: _known(a.svc, b.svc, "a"))
        event = await requested(a.svc.bus, "c")
        record, revision = await a.svc.claims.get("c")
        marked, at = await lease.take(a.svc.claims, a.svc.placer_id, record, revision)
        assert marked.placer == a.svc.placer_id
        with pytest.raises(lease.ClaimBusy, match=f"being placed by {a.svc.placer_id}"):
            await b.svc.place(msgspec.structs.replace(event, record_revision=0))
        assert (await b.svc.ledger.read_node("n1"))[0].entries == {}
        assert (await b.svc.ledger.read_node("n2"))[0].entries == {}
        # The holder died with the lease: once it runs out the peer places the claim.
        await a.svc.claims.replace(msgspec.structs.replace(marked, placing_until=time.time() - 1), at)
        assert await b.svc.place(msgspec.structs.replace(event, record_revision=0))
        placed = (await b.svc.claims.get("c"))[0]
        assert placed.state == "allocated" and placed.placer == "" and placed.placing_until == 0.0


def _delivery(event, num_delivered: int, msg_id: str) -> Delivery:
    return Delivery(subjects.claim(event.tenant, event.claim, "requested"), {"Nats-Msg-Id": msg_id}, b"",
                    num_delivered)


async def test_only_the_translators_first_delivery_takes_the_batch_path(nats_url):
    async with replicas(nats_url) as [r]:
        await tenant(r.svc.bus, "a")
        await eventually(lambda: _known(r.svc, r.svc, "a"))
        event = await requested(r.svc.bus, "c")
        assert r.svc._fast(event, set(), _delivery(event, 1, "c:requested"))
        assert not r.svc._fast(event, set(), _delivery(event, 2, "c:requested")), "a redelivery"
        assert not r.svc._fast(event, set(), _delivery(event, 1, "a-tenants-copy")), "a tenant's duplicate"


async def test_the_group_commit_refuses_a_claim_the_view_knows_on_another_node(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        held = LedgerEntry(claim="c", tenant="a", shares=[DeviceShare(uuid="GPU-n1-0", index=0, memory_mib=1000,
                                                                      cores=10)])
        await svc.ledger.write_node(NodeLedger(node="n1", entries={"c": held}), None)
        await eventually(lambda: _on(svc, "c", "n1"))
        second = LedgerEntry(claim="c", tenant="a", shares=[DeviceShare(uuid="GPU-n2-0", index=0, memory_mib=1000,
                                                                        cores=10)])
        with pytest.raises(ConflictError, match="already placed on n1"):
            await svc._commit("n2", second)
        assert (await svc.ledger.read_node("n2"))[0].entries == {}


async def _on(svc, claim, node) -> bool:
    return svc.claim_nodes.get(claim) == node


async def test_a_batch_that_decided_past_half_its_ack_wait_places_through_the_lease(nats_url, monkeypatch):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a")
        await eventually(lambda: _known(svc, svc, "a"))
        event = await requested(svc.bus, "c")
        # As if the process had been stopped while deciding: every batch is late.
        svc.bus.settings = dataclasses.replace(svc.bus.settings, ack_wait=0)
        leased = []
        real = lease.take

        async def take(*args):
            leased.append(args[2].claim)
            return await real(*args)

        monkeypatch.setattr(lease, "take", take)
        assert await svc.handle_batch([(event, _delivery(event, 1, "c:requested"))]) == [None]
        assert leased == ["c"], "the late batch wrote its ledger entry without the placing lease"
        assert (await svc.claims.get("c"))[0].state == "allocated"


async def test_the_batch_path_racing_a_leased_path_never_holds_the_claim_on_two_nodes(nats_url):
    """The translator's first delivery (the batch path) on one replica and a leased path on another
    (here a tenant's copy of the same ``requested`` under another message id; a retry or a
    redelivery takes the same path) reach the ledger write within the same moment."""
    async with replicas(nats_url, 2) as [a, b]:
        await tenant(a.svc.bus, "a")
        await eventually(lambda: _known(a.svc, b.svc, "a"))
        event = await requested(a.svc.bus, "c")
        for replica, other in ((a, "n2"), (b, "n1")):
            replica.svc.placer.place = partial(replica.svc.placer.place, exclude_nodes=(other,))
        both_there = asyncio.Barrier(2)

        async def meet() -> None:
            try:
                await asyncio.wait_for(both_there.wait(), 1.0)
            except TimeoutError:  # the other was refused before its ledger write: go alone
                pass

        real_batch_commit = a.svc.committer.commit_booked

        async def batch_commit(booked):
            await meet()
            return await real_batch_commit(booked)

        a.svc.committer.commit_booked = batch_commit
        real_commit = b.svc._commit

        async def leased_commit(node, entry, *args):
            await meet()
            return await real_commit(node, entry, *args)

        b.svc._commit = leased_commit
        revisions: list[dict[str, set[str]]] = []
        watch = asyncio.create_task(_watch_ledger(await a.svc.bus.kv(subjects.KV_LEDGER), revisions))
        try:
            outcomes = await asyncio.gather(
                a.svc.handle_batch([(event, _delivery(event, 1, "c:requested"))]),
                b.svc.handle_batch([(msgspec.structs.replace(event, record_revision=0),
                                     _delivery(event, 1, "a-tenants-copy"))]))
            record = (await a.svc.claims.get("c"))[0]
            assert record.state == "allocated", outcomes
            await eventually(lambda: _seen(revisions, record.node))
        finally:
            await cancel_and_wait([watch])
        doubled = [r for r in revisions if sum("c" in claims for claims in r.values()) > 1]
        assert not doubled, f"ledger revisions holding c on two nodes: {doubled}"
        # the loser was told to try again later (its redelivery finds the claim allocated)
        assert sum(o == [None] for o in outcomes) >= 1, outcomes


async def test_the_group_commit_refuses_an_entry_whose_placing_lease_runs_out(nats_url):
    """A holder that got to its ledger write too late (stopped, starved) writes nothing: by then a
    peer may have taken the lease over and be writing the claim into another node's ledger."""
    async with replicas(nats_url) as [r]:
        svc = r.svc
        late = LedgerEntry(claim="c", tenant="a", shares=[DeviceShare(uuid="GPU-n1-0", index=0, memory_mib=1000,
                                                                      cores=10)])
        with pytest.raises(ConflictError, match="placing lease ran out"):
            await svc._commit("n1", late, time.time() + lease.WRITE_MARGIN / 2)
        assert (await svc.ledger.read_node("n1"))[0].entries == {}
        await svc._commit("n1", late, time.time() + lease.LEASE_SECONDS)
        assert set((await svc.ledger.read_node("n1"))[0].entries) == {"c"}
