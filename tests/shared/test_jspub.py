"""Pipelined JetStream publishing against a real nats-server: acks in order, refusals per item."""

from __future__ import annotations

import asyncio

import nats

from tessera.shared.jspub import Publisher, PubAck, PublishError, publisher


async def test_every_item_gets_its_own_ack_or_its_own_refusal(nats_url):
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="S", subjects=["s.>"])
        kv = await js.create_key_value(bucket="b")
        revision = await kv.put("k", b"1")
        items = [("s.a", b"a", None), ("nowhere.x", b"x", None),
                 ("$KV.b.k", b"2", {"Nats-Expected-Last-Subject-Sequence": str(revision)}),
                 ("$KV.b.k", b"3", {"Nats-Expected-Last-Subject-Sequence": str(revision)}),  # now stale
                 ("s.b", b"b", {"Nats-Msg-Id": "once"}), ("s.b", b"b", {"Nats-Msg-Id": "once"})]
        first, no_stream, won, lost, fresh, again = await publisher(nc).publish(items)
        assert isinstance(first, PubAck) and first.stream == "S"
        assert isinstance(no_stream, PublishError) and no_stream.code == 503 and "no stream" in str(no_stream)
        assert isinstance(won, PubAck) and won.seq > revision
        assert isinstance(lost, PublishError) and lost.wrong_last_sequence
        assert (await kv.get("k")).value == b"2"  # the losing write changed nothing
        assert isinstance(fresh, PubAck) and not fresh.duplicate
        assert isinstance(again, PubAck) and again.duplicate and again.seq == fresh.seq
    finally:
        await nc.close()


async def test_concurrent_batches_share_one_inbox_and_keep_their_own_acks(nats_url):
    nc = await nats.connect(nats_url)
    try:
        await nc.jetstream().add_stream(name="S", subjects=["s.>"])
        pub = publisher(nc)
        assert publisher(nc) is pub
        batches = [[(f"s.{b}", f"{b}-{i}".encode(), None) for i in range(200)] for b in range(5)]
        results = await asyncio.gather(*(pub.publish(batch) for batch in batches))
        seqs = [a.seq for acks in results for a in acks]
        assert all(isinstance(a, PubAck) for acks in results for a in acks)
        assert sorted(seqs) == list(range(1, 1001))  # each publish stored once, each ack to its own caller
        assert not pub._waiting
    finally:
        await nc.close()


async def test_a_publish_nobody_answers_times_out_instead_of_hanging(nats_url):
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe("quiet.>")  # a plain subscriber takes the message and never replies
        [result] = await Publisher(nc, timeout=0.5).publish([("quiet.x", b"x", None)])
        assert isinstance(result, TimeoutError)
        await sub.unsubscribe()
    finally:
        await nc.close()
