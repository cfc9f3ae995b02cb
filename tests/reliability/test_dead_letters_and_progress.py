"""Window 9 and long handlers: a message is dead-lettered exactly once and never lost on the way.

Against a real nats-server: a dead letter whose publish fails must not cost the message (it is
redelivered, not terminated); a redelivered message that was already dead-lettered does not leave a
second letter; a message the consumer never settles (its handler killed on every delivery) still
leaves a letter once ``max_deliver`` is spent; and a handler that runs past ``ack_wait`` keeps its
message (``in_progress``) instead of having it redelivered to a peer.
"""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.msg import Msg

from tessera.shared import subjects
from tessera.shared.bus import Bus, Subscription
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.errors import PermanentError, TemporaryError
from tessera.shared.events import ClaimReleaseRequested, claim_decoder, dlq_decoder
from tessera.shared.settings import BusSettings

from kit import eventually


def release(claim: str) -> ClaimReleaseRequested:
    return ClaimReleaseRequested(claim=claim, tenant="t")


async def connect(url: str, **kwargs) -> Bus:
    b = await Bus.connect(BusSettings(url=url, **kwargs), "test")
    await b.ensure_topology()
    return b


@pytest.fixture
def bus_settings(nats_url) -> BusSettings:
    """The kit's `bus` with few deliveries and a short ack wait: retries and letters come soon."""
    return BusSettings(url=nats_url, max_deliver=3, ack_wait=2)


def consumer(bus: Bus, handler) -> asyncio.Task:
    return asyncio.create_task(bus.consume(Subscription(
        stream=subjects.STREAM_CLAIMS, durable="probe", filter_subjects=[subjects.claims_of_kind("release")],
        decoder=claim_decoder, handler=handler,
    )))


async def stop(*tasks: asyncio.Task) -> None:
    await cancel_and_wait(tasks)


async def settled(bus: Bus) -> bool:
    """Whether the consumer holds no message: every one delivered and acked (or terminated)."""
    info = await bus.consumer_info(subjects.STREAM_CLAIMS, "probe")
    return info.num_ack_pending == 0 and info.num_pending == 0


async def refused_until(bus: Bus, claim: str, condition) -> list[int]:
    """Publish a release for ``claim`` and consume it with a handler that always refuses it for
    good, until ``condition(deliveries)`` holds and the bus has tried to dead-letter each delivery
    (the verdict the test then reads)."""
    calls: list[int] = []
    tried: list[int] = []
    dead_letter = bus.dead_letter

    async def handler(event, delivery):
        calls.append(delivery.num_delivered)
        raise PermanentError("tenant is gone")

    async def counted_dead_letter(*args, **kwargs):
        try:
            return await dead_letter(*args, **kwargs)
        finally:
            tried.append(1)

    bus.dead_letter = counted_dead_letter  # (the bus's own, or the test's wrapper of it)
    await bus.publish(subjects.claim("t", claim, "release"), release(claim), msg_id=f"{claim}:release")
    task = consumer(bus, handler)
    try:
        await eventually(lambda: condition(calls) and len(tried) >= len(calls))
    finally:
        await stop(task)
    return calls


async def letters(bus: Bus) -> list:
    info = await bus.stream_info(subjects.STREAM_DLQ)
    if not info.state.messages:
        return []
    return [dlq_decoder.decode((await bus.stored_message(subjects.STREAM_DLQ, seq)).data)
            for seq in range(info.state.first_seq, info.state.last_seq + 1)]


async def test_failed_dead_letter_publish_redelivers_instead_of_dropping(bus):
    real = bus.dead_letter
    failed = []

    async def dead_letter_down_once(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise TemporaryError("DLQ stream unavailable")
        await real(*args, **kwargs)

    bus.dead_letter = dead_letter_down_once
    await refused_until(bus, "d1", lambda calls: len(calls) >= 2)
    found = await letters(bus)
    assert len(found) == 1 and "tenant is gone" in found[0].reason


async def test_redelivered_dead_letter_is_stored_once_and_names_its_stream(bus, monkeypatch):
    async def term_lost(self, *args, **kwargs):  # the terminate never reaches the server
        return None

    monkeypatch.setattr(Msg, "term", term_lost)
    await refused_until(bus, "d2", lambda calls: len(calls) >= 2)
    found = await letters(bus)
    assert len(found) == 1
    assert found[0].stream == subjects.STREAM_CLAIMS


async def test_max_deliver_spent_without_a_verdict_still_leaves_a_dead_letter(bus, nats_url):
    """Every delivery dies with its handler (no ack, nak or term): the server gives up after
    ``max_deliver``; the bus's watch on the consumer's advisories turns that into a letter."""
    bound = consumer(bus, lambda event, delivery: asyncio.sleep(0))
    # the consumer loop has created the durable (consumer_info raises until then)
    await eventually(lambda: bus.consumer_info(subjects.STREAM_CLAIMS, "probe"))
    await stop(bound)
    watch = asyncio.create_task(bus.watch_exhausted(subjects.STREAM_CLAIMS, "probe"))
    await asyncio.sleep(0.2)
    await bus.publish(subjects.claim("t", "d3", "release"), release("d3"), msg_id="d3:release")
    # A raw pull on the same durable takes every delivery and drops it, like a process killed
    # mid-handler each time.
    crasher = await Bus.connect(BusSettings(url=nats_url), "crasher")
    found: list = []
    try:
        sub = await crasher.pull_subscribe_bind("probe", stream=subjects.STREAM_CLAIMS)
        pulled = 0
        deadline = asyncio.get_running_loop().time() + 20
        while not found and asyncio.get_running_loop().time() < deadline:
            try:  # (a delivery may also land on a pull that just expired: it is lost the same way)
                pulled += len(await sub.fetch(1, timeout=1.0))
            except Exception:
                pass
            found = await letters(bus)
    finally:
        await stop(watch)
        await crasher.close()
    assert pulled >= 1
    assert len(found) == 1 and "d3" in found[0].subject and "3 deliveries" in found[0].reason


async def test_handler_past_ack_wait_keeps_its_message_from_a_peer(nats_url):
    first = await connect(nats_url, ack_wait=1, max_deliver=5)
    second = await connect(nats_url, ack_wait=1, max_deliver=5)
    calls = []
    done = []

    async def slow(event, delivery):
        calls.append(delivery.num_delivered)
        await asyncio.sleep(3.5)  # well past ack_wait: only progress signals keep the message
        done.append(delivery.num_delivered)

    await first.publish(subjects.claim("t", "d4", "release"), release("d4"), msg_id="d4:release")
    tasks = [consumer(first, slow), consumer(second, slow)]
    try:
        # handled and acked; a redelivery to the peer (at ack_wait, long before) would be held by it
        await eventually(lambda: done and settled(first))
    finally:
        await stop(*tasks)
        await first.close()
        await second.close()
    assert calls == [1]
