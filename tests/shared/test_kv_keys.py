"""Listing a KV bucket's keys (and values): exact, never a spurious "empty", deletes and purges left out."""

from __future__ import annotations

import asyncio
import contextlib

import nats

from tessera.shared.kvkeys import live_entries, live_keys


@contextlib.asynccontextmanager
async def bucket(nats_url, name):
    """A fresh KV bucket (history 5) and its connection, closed afterwards."""
    nc = await nats.connect(nats_url)
    try:
        yield nc, await nc.jetstream().create_key_value(bucket=name, history=5)
    finally:
        await nc.close()


async def test_empty_bucket_has_no_keys(nats_url):
    async with bucket(nats_url, "empty") as (nc, kv):
        assert await live_keys(kv) == []


async def test_deleted_and_purged_keys_are_left_out_and_history_is_not_counted_twice(nats_url):
    async with bucket(nats_url, "mixed") as (nc, kv):
        for i in range(30):
            await kv.put(f"node.n{i}", b"x")
            await kv.put(f"node.n{i}", b"y")  # a second revision of the same key
        await kv.delete("node.n3")
        await kv.purge("node.n4")
        await kv.put("node.n4", b"back")  # purged, then written again
        expected = sorted({f"node.n{i}" for i in range(30)} - {"node.n3"})
        assert await live_keys(kv) == expected


async def test_a_full_bucket_is_never_read_as_empty_under_concurrent_readers(nats_url):
    """nats-py's keys() could answer "no keys" when the consumer info overtook the pushed messages."""
    async with bucket(nats_url, "busy") as (nc, kv):
        for i in range(700):  # more than one fetch batch
            await kv.put(f"c{i:04d}", b"v")
        results = await asyncio.gather(*(live_keys(kv) for _ in range(40)))
        assert all(len(r) == 700 for r in results)
        # and nothing is left behind on the server: every listing deletes its consumer
        info = await nc.jetstream().stream_info("KV_busy")
        assert info.state.consumer_count == 0


async def test_entries_are_the_latest_values_with_their_revisions(nats_url):
    async with bucket(nats_url, "values") as (nc, kv):
        for i in range(600):  # more than one fetch batch
            await kv.put(f"c{i:04d}", b"old")
        latest = {f"c{i:04d}": await kv.put(f"c{i:04d}", f"v{i}".encode()) for i in range(0, 600, 3)}
        await kv.delete("c0001")
        entries = await live_entries(kv)
        assert len(entries) == 599 and "c0001" not in entries
        for key, revision in latest.items():
            assert entries[key] == (f"v{int(key[1:])}".encode(), revision)
        assert entries["c0002"][0] == b"old"
        assert (await kv.get("c0002")).revision == entries["c0002"][1]
