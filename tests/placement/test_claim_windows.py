"""Issue 12's placement windows, each reproduced by interleaving the commit's steps on real buckets.

Every test here failed against the code before the fix (the commit that added it says so): a claim
allocated with no ledger entry, a winner's quota returned by a loser, a tenant under- or
over-charged, a batch error or one malformed bucket value ending placement's loops.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tessera.placement.service import PlacementService
from tessera.shared import subjects
from tessera.shared.bus import Delivery
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.errors import ConflictError, PermanentError
from tessera.shared.events import ClaimReleaseRequested, DeviceShare, GpuQuota, LedgerEntry, NodeLedger, encode

from kit import eventually
from placementkit import replicas, requested, tenant

LIMITED = GpuQuota(gpus=8)


def share(node: str, gpu: int) -> DeviceShare:
    return DeviceShare(uuid=f"GPU-{node}-{gpu}", index=gpu, memory_mib=1000, cores=10)


def entry(claim: str, node: str, gpu: int, tenant_name: str = "a") -> LedgerEntry:
    return LedgerEntry(claim=claim, tenant=tenant_name, shares=[share(node, gpu)])


def delivery(event, node: str = subjects.NO_NODE) -> Delivery:
    kind = "requested" if type(event).__name__ == "ClaimRequested" else "release"
    return Delivery(subjects.claim(event.tenant, event.claim, kind, node), {}, b"", 1)


async def usage_of(svc: PlacementService, tenant_name: str = "a") -> set[str]:
    return set((await svc.ledger.read_tenant(tenant_name))[0].claims)


async def test_same_claim_twice_on_one_node_is_a_conflict_not_a_second_entry(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await svc.ledger.write_node(NodeLedger(node="n1", entries={"c": entry("c", "n1", 0)}), None)
        await eventually(lambda: _holds(svc, "n1", "c"))
        with pytest.raises(ConflictError, match="already placed on n1 on other GPUs"):
            await svc._commit("n1", entry("c", "n1", 1))
        held = (await svc.ledger.read_node("n1"))[0].entries["c"]
        assert [s.uuid for s in held.shares] == ["GPU-n1-0"]


async def _holds(svc, node, claim) -> bool:
    return claim in svc.node_ledgers.get(node, (NodeLedger(node=node), None))[0].entries


async def test_a_loser_on_another_node_never_returns_the_winners_quota(nats_url):
    async with replicas(nats_url, 2) as [a, b]:
        await tenant(a.svc.bus, "a", LIMITED)
        await eventually(lambda: _known(b.svc, "a"))
        event = await requested(a.svc.bus, "c")
        assert await a.svc.place(event)  # the winner: quota, ledger on its node, record allocated
        winner = (await a.svc.claims.get("c"))[0]
        other = "n2" if winner.node == "n1" else "n1"
        # The loser had decided the same claim before the winner's record write landed: its quota
        # reservation (the same key) and its entry on the other node (written here straight into
        # the ledger: placement itself now refuses it, test_one_claim_one_node.py), then its
        # record CAS loses.
        lost = entry("c", other, 0)
        ledger, at = await b.svc.ledger.read_node(other)
        await b.svc.ledger.write_node(NodeLedger(node=other, entries=ledger.entries | {"c": lost}), at)
        base = msgspec.structs.replace(winner, state="requested", node="", devices=[])
        assert not await b.svc._finish(event, other, lost, base, event.record_revision)
        assert "c" in await usage_of(a.svc), "the loser's rollback returned the winner's quota"
        assert "c" not in (await a.svc.ledger.read_node(other))[0].entries
        assert "c" in (await a.svc.ledger.read_node(winner.node))[0].entries


async def _known(svc, name) -> bool:
    return name in svc.tenants_known


async def test_a_redelivered_finish_never_allocates_from_memory_a_ledger_entry_that_is_gone(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a")
        await eventually(lambda: _known(svc, "a"))
        event = await requested(svc.bus, "c")
        # Ledger written, claim record not (a crash): the view remembers the entry ...
        written = await svc.ledger.write_node(NodeLedger(node="n1", entries={"c": entry("c", "n1", 0)}), None)
        await eventually(lambda: _holds(svc, "n1", "c"))
        # ... then the enforcer drops it as an orphan, and the redelivery comes before the watcher.
        await cancel_and_wait(r.tasks.values())
        await svc.ledger.write_node(NodeLedger(node="n1"), written)
        assert await svc.place(msgspec.structs.replace(event, record_revision=0))
        record = (await svc.claims.get("c"))[0]
        held = (await svc.ledger.read_node(record.node))[0].entries.get("c")
        assert record.state == "allocated"
        assert held is not None and held.shares == record.devices, "allocated with no ledger entry"


async def test_a_ledger_write_that_timed_out_but_committed_still_charges_the_tenant(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a", LIMITED)
        await eventually(lambda: _known(svc, "a"))
        event = await requested(svc.bus, "c")
        write_nodes = svc.ledger.write_nodes

        async def committed_then_timed_out(items):
            await write_nodes(items)
            raise asyncio.TimeoutError("no reply from the server")

        svc.ledger.write_nodes = committed_then_timed_out
        with pytest.raises(asyncio.TimeoutError):
            await svc.place(event)
        svc.ledger.write_nodes = write_nodes
        await eventually(lambda: _holds(svc, "n1", "c") or _holds(svc, "n2", "c"))
        assert await svc.place(msgspec.structs.replace(event, record_revision=0))  # the redelivery
        assert (await svc.claims.get("c"))[0].state == "allocated"
        assert "c" in await usage_of(svc), "the tenant holds a GPU its quota does not count"


async def test_a_release_before_the_redelivery_returns_the_quota_reserved_before_a_crash(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a", LIMITED)
        event = await requested(svc.bus, "c")
        usage, revision = await svc.ledger.read_tenant("a")
        await svc.ledger.reserve_quota("a", "c", GpuQuota(gpus=1), usage, revision)  # then: crash
        release = ClaimReleaseRequested(claim="c", tenant="a", reason="user")
        await svc.handle(release, delivery(release))
        assert (await svc.claims.get("c"))[0].state == "released"
        assert "c" not in await usage_of(svc)
        assert event.claim == "c"


async def test_a_requested_for_another_tenants_claim_is_refused(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a")
        await tenant(svc.bus, "b")
        await eventually(lambda: _known(svc, "b"))
        event = await requested(svc.bus, "c", "a")
        theirs = msgspec.structs.replace(event, tenant="b", record_revision=0)
        with pytest.raises(PermanentError, match="belongs to tenant 'a'"):
            await svc.handle(theirs, delivery(theirs))
        record = (await svc.claims.get("c"))[0]
        assert record.state == "requested" and record.tenant == "a"


async def test_an_error_outside_the_per_claim_handler_does_not_end_the_batch_consumer(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        await tenant(svc.bus, "a")
        await eventually(lambda: _known(svc, "a"))
        events = [await requested(svc.bus, f"c{i}") for i in range(3)]

        async def connection_lost(items):
            raise OSError("connection lost")

        svc.claims.replace_many = connection_lost
        outcomes = await svc.handle_batch([(e, delivery(e)) for e in events])
        assert len(outcomes) == 3 and all(o is not None for o in outcomes)  # redelivered, not acked
        assert not any(isinstance(o, PermanentError) for o in outcomes)


async def test_one_malformed_value_in_each_watched_bucket_is_skipped_and_the_watchers_live(nats_url):
    async with replicas(nats_url) as [r]:
        svc = r.svc
        for bucket, key in ((subjects.KV_INVENTORY, "bad"), (subjects.KV_TENANTS, "bad"),
                            (subjects.KV_LEDGER, "node.n1"), (subjects.KV_LEDGER, "tenant.a")):
            await (await svc.bus.kv(bucket)).put(key, b'{"not": "valid"')
        await tenant(svc.bus, "later")
        await eventually(lambda: _known(svc, "later"))
        assert sorted(r.alive()) == ["watch-inventory", "watch-ledger", "watch-tenants"]
        await (await svc.bus.kv(subjects.KV_LEDGER)).put("node.n2", encode(
            NodeLedger(node="n2", entries={"x": entry("x", "n2", 0)})))
        await eventually(lambda: _holds(svc, "n2", "x"))
