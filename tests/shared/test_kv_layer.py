"""The typed KV layer: a lost compare-and-set is classified by code, retries are bounded, and one
malformed value is skipped (logged, counted) by every reader of a whole bucket instead of raising."""

from __future__ import annotations

import contextlib

import nats
import pytest

from tessera.shared import kv as kvmod
from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import ConflictError, TemporaryError
from tessera.shared.events import ClaimRecord, ClaimSpec, DeviceShare, LedgerEntry, NodeInventory, NodeLedger, \
    TenantRecord, encode
from tessera.shared.inventory import InventoryStore, TenantDirectory, is_lost, with_lost
from tessera.shared.kv import BadValue, Bucket, CasLost, cas_lost, retry_cas
from tessera.shared.ledger import Ledger


@contextlib.asynccontextmanager
async def bucket(nats_url, name):
    nc = await nats.connect(nats_url)
    try:
        yield await nc.jetstream().create_key_value(bucket=name, history=5)
    finally:
        await nc.close()


def record(claim: str, tenant: str = "a") -> ClaimRecord:
    return ClaimRecord(claim=claim, tenant=tenant, state="requested", spec=ClaimSpec())


async def test_claimstore_all_skips_a_malformed_record_and_counts_it(nats_url, caplog):
    async with bucket(nats_url, "claims") as kv:
        store = ClaimStore(kv)
        await store.create(record("c1"))
        await kv.put("c2", b'{"claim": 7}')
        await store.create(record("c3"))
        before = kvmod.SKIPPED["claims"]
        assert [r.claim for r in await store.all()] == ["c1", "c3"]
        assert kvmod.SKIPPED["claims"] == before + 1
        assert "claims/c2 holds a malformed value" in caplog.text
        with pytest.raises(BadValue, match=r"claims/c2 .*\$\.claim"):
            await store.get("c2")


async def test_create_of_an_existing_key_and_a_stale_update_are_lost_races(nats_url):
    async with bucket(nats_url, "b") as kv:
        b = Bucket(kv, TenantRecord, "tenants")
        rev = await b.put("t", TenantRecord(tenant="t"), revision=None)
        assert await b.create("t", TenantRecord(tenant="t")) is None
        with pytest.raises(CasLost) as lost:
            await b.put("t", TenantRecord(tenant="t"), revision=rev + 10)
        assert cas_lost(lost.value) and isinstance(lost.value, ConflictError)
        assert await b.replace("t", TenantRecord(tenant="t"), rev) == rev + 1


async def test_modify_rereads_a_lost_race_and_gives_up_after_the_bound(nats_url):
    async with bucket(nats_url, "b") as kv:
        b = Bucket(kv, TenantRecord, "tenants")
        await b.put("t", TenantRecord(tenant="t"), revision=None)
        read = b.get
        peer_wrote = []

        async def read_then_a_peer_writes(key):
            stored = await read(key)
            if not peer_wrote:  # between our read and our write, once
                peer_wrote.append(await kv.put(key, encode(TenantRecord(tenant="t", phase="Peer"))))
            return stored

        b.get = read_then_a_peer_writes
        seen = []

        def change(value):
            seen.append(value.phase)
            return TenantRecord(tenant="t", phase=value.phase + "+me")

        stored, _ = await b.modify("t", change)
        assert seen == ["Ready", "Peer"] and stored.phase == "Peer+me"
        assert (await read("t")).value.phase == "Peer+me"

        attempts = 0

        async def always_lost():
            nonlocal attempts
            attempts += 1
            raise CasLost("moved")

        with pytest.raises(ConflictError, match="kept losing after 3 attempts"):
            await retry_cas(always_lost, attempts=3)
        assert attempts == 3


async def test_ledger_scans_skip_a_malformed_node_and_the_same_claim_is_never_room_to_add(nats_url):
    from tessera.shared.ledger import check_fit
    async with bucket(nats_url, "ledger") as kv:
        ledger = Ledger(kv)
        await ledger.write_node(NodeLedger(node="n1"), None)
        await kv.put("node.n2", b"not json")
        assert list(await ledger.all_nodes()) == ["n1"]
    inv = NodeInventory(node="n", devices=[])
    share = DeviceShare(uuid="GPU-0", index=0, memory_mib=10, cores=10)
    other = DeviceShare(uuid="GPU-1", index=1, memory_mib=10, cores=10)
    held = NodeLedger(node="n", entries={"c": LedgerEntry(claim="c", tenant="a", shares=[share])})
    assert check_fit(inv.devices, held, LedgerEntry(claim="c", tenant="a", shares=[share])) is None
    assert "already placed on n on other GPUs" in check_fit(inv.devices, held,
                                                            LedgerEntry(claim="c", tenant="a", shares=[other]))


async def test_inventory_store_and_tenant_directory(nats_url):
    async with bucket(nats_url, "inventory") as kv:
        store = InventoryStore(kv)
        await kv.put("n1", encode(NodeInventory(node="n1", devices=[], labels=with_lost({}, True))))
        await kv.put("n2", b"[]")
        nodes = await store.all()
        assert list(nodes) == ["n1"] and is_lost(nodes["n1"])
        assert not is_lost(NodeInventory(node="x", devices=[], labels=with_lost({"tessera.dev/lost": "true"}, False)))
    async with bucket(nats_url, "tenants") as kv:
        directory = TenantDirectory(kv)
        await kv.put("a", encode(TenantRecord(tenant="a")))
        assert await directory.exists("a") and not await directory.exists("b")
        await kv._js._nc.close()  # the bucket cannot be read: that is no answer about the tenant
        with pytest.raises(TemporaryError, match="cannot read tenant 'b'"):
            await directory.lookup("b")
