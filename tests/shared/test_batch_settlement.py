"""A batch handler's outcome for an item settles its message exactly as the same exception raised
by a handler of one message does: acked, redelivered, or dead-lettered once with the same reason —
against a real nats-server, for `Bus.consume` and `Bus.consume_batches` side by side."""

from __future__ import annotations

import asyncio

import pytest

from tessera.shared import subjects
from tessera.shared.bus import BatchSubscription, Bus, Subscription
from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.events import ClaimReleaseRequested, claim_decoder
from tessera.shared.settings import BusSettings

from test_bus_delivery import dlq


@pytest.fixture
async def bus(nats_url):
    b = await Bus.connect(BusSettings(url=nats_url, max_deliver=3, ack_wait=2), "test")
    await b.ensure_topology()
    yield b
    await b.close()


async def eventually(condition, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not await condition():
            await asyncio.sleep(0.05)


def consumer(bus: Bus, mode: str, outcome) -> tuple[asyncio.Task, list[int]]:
    """A consumer whose handler meets every message with ``outcome`` (None or an exception);
    returns it and the delivery numbers it saw."""
    seen: list[int] = []
    what = dict(stream=subjects.STREAM_CLAIMS, durable="probe", filter_subjects=[subjects.claims_of_kind("release")],
                decoder=claim_decoder)

    async def one(event, delivery) -> None:
        seen.append(delivery.num_delivered)
        if outcome is not None:
            raise outcome

    async def batch(items):
        seen.extend(delivery.num_delivered for _, delivery in items)
        return [outcome for _ in items]

    run = bus.consume(Subscription(**what, handler=one)) if mode == "one" else \
        bus.consume_batches(BatchSubscription(**what, handler=batch))
    return asyncio.create_task(run), seen


async def settled(bus: Bus) -> bool:
    info = await bus.consumer_info(subjects.STREAM_CLAIMS, "probe")
    return info.num_pending == 0 and info.num_ack_pending == 0


async def settled_after(bus: Bus, seen: list[int]) -> bool:
    return bool(seen) and await settled(bus)


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("mode", ["one", "batch"])
async def test_done_is_acked_once(bus, mode):
    task, seen = consumer(bus, mode, None)
    try:
        await bus.publish(subjects.claim("t", "c1", "release"), ClaimReleaseRequested(claim="c1", tenant="t"))
        await eventually(lambda: settled_after(bus, seen))
    finally:
        await stop(task)
    assert seen == [1] and await dlq(bus) == []


@pytest.mark.parametrize("mode", ["one", "batch"])
async def test_a_temporary_error_is_redelivered_then_dead_lettered_with_the_same_reason(bus, mode):
    task, seen = consumer(bus, mode, TemporaryError("peer down", delay=0.05))
    try:
        await bus.publish(subjects.claim("t", "c2", "release"), ClaimReleaseRequested(claim="c2", tenant="t"))

        async def lettered() -> bool:
            return len(await dlq(bus)) == 1 and await settled(bus)

        await eventually(lettered)
    finally:
        await stop(task)
    [letter] = await dlq(bus)
    assert seen == [1, 2, 3]
    assert letter.reason == "gave up after 3 deliveries: peer down" and letter.deliveries == 3


@pytest.mark.parametrize("mode", ["one", "batch"])
async def test_a_permanent_error_and_a_bad_payload_are_dead_lettered_once_each(bus, mode):
    task, seen = consumer(bus, mode, PermanentError("tenant is gone"))
    try:
        await bus.publish(subjects.claim("t", "c3", "release"), ClaimReleaseRequested(claim="c3", tenant="t"))
        await bus.publish_bytes(subjects.claim("t", "c4", "release"), b'{"kind": "release", "claim": 7}')

        async def lettered() -> bool:
            return len(await dlq(bus)) == 2 and await settled(bus)

        await eventually(lettered)
    finally:
        await stop(task)
    reasons = sorted(letter.reason for letter in await dlq(bus))
    assert seen == [1]  # the bad payload never reaches a handler
    assert reasons[0].startswith("invalid payload") and "$.claim" in reasons[0]
    assert reasons[1] == "tenant is gone"


async def test_a_conflict_a_batch_handler_reports_is_redelivered_and_dead_lettered_by_the_bus_at_max_deliver(bus):
    task, seen = consumer(bus, "batch", ConflictError("the record moved"))
    try:
        await bus.publish(subjects.claim("t", "c5", "release"), ClaimReleaseRequested(claim="c5", tenant="t"))

        async def lettered() -> bool:
            return len(await dlq(bus)) == 1 and await settled(bus)

        await eventually(lettered)
    finally:
        await stop(task)
    [letter] = await dlq(bus)
    assert seen == [1, 2, 3]
    assert letter.reason == "gave up after 3 deliveries: compare-and-set lost: the record moved"
