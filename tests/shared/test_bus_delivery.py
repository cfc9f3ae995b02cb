"""The bus's delivery rules, against a real nats-server: dedupe, ack, retry, conflict, dead-letter."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.js.errors import NotFoundError

from tessera.shared import subjects
from tessera.shared.bus import Bus, Subscription
from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.events import ClaimReleaseRequested, claim_decoder, dlq_decoder
from tessera.shared.settings import BusSettings
from tessera.shared.telemetry import Telemetry

from kit import eventually
from tessera.shared.cancelling import cancel_and_wait


@pytest.fixture
def bus_settings(nats_url) -> BusSettings:
    """The kit's `bus` with few deliveries and a short ack wait: retries and letters come soon."""
    return BusSettings(url=nats_url, max_deliver=3, ack_wait=2)


def release(claim: str) -> ClaimReleaseRequested:
    return ClaimReleaseRequested(claim=claim, tenant="t")


async def run_consumer(bus: Bus, handler, until, timeout=15.0):
    """Consume until ``until()`` (plain or async) holds. Where the test reads the verdict (ack, nak,
    dead letter) of the message in hand, ``until`` waits for that verdict too: the loop must get to
    it before it is cancelled."""
    task = asyncio.create_task(bus.consume(Subscription(
        stream=subjects.STREAM_CLAIMS, durable="probe", filter_subjects=[subjects.claims_of_kind("release")],
        decoder=claim_decoder, handler=handler,
    )))
    try:
        await eventually(until, timeout=timeout, every=0.05, what="the consumer's outcome")
    finally:
        await cancel_and_wait([task])


async def settled(bus: Bus, durable: str = "probe") -> bool:
    """Whether the consumer holds no message: every one delivered and acked (or terminated)."""
    info = await bus.consumer_info(subjects.STREAM_CLAIMS, durable)
    return info.num_ack_pending == 0 and info.num_pending == 0


async def pull_request_open(bus: Bus, durable: str) -> bool:
    """Whether the consumer exists and a fetch of its loop waits on the server."""
    try:
        return (await bus.consumer_info(subjects.STREAM_CLAIMS, durable)).num_waiting > 0
    except NotFoundError:
        return False


async def dlq(bus: Bus) -> list:
    info = await bus.stream_info(subjects.STREAM_DLQ)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        out.append(dlq_decoder.decode((await bus.stored_message(subjects.STREAM_DLQ, seq)).data))
    return out


async def test_same_msg_id_is_stored_once(bus):
    for _ in range(3):
        await bus.publish(subjects.claim("t", "c1", "release"), release("c1"), msg_id="c1:release")
    info = await bus.stream_info(subjects.STREAM_CLAIMS)
    assert info.state.messages == 1


async def test_publish_carries_traceparent_and_handler_continues_the_trace(bus):
    tel = Telemetry("test", None)
    bus.telemetry = tel
    seen = []

    async def handler(event, delivery):
        seen.append(delivery.headers.get("traceparent", ""))

    with tel.span("origin") as span:
        await bus.publish(subjects.claim("t", "c2", "release"), release("c2"))
        origin = format(span.get_span_context().trace_id, "032x")
    await run_consumer(bus, handler, lambda: seen)
    assert seen[0].split("-")[1] == origin


async def test_conflict_is_retried_at_once_then_acked(bus):
    calls = []

    async def handler(event, delivery):
        calls.append(delivery.num_delivered)
        if len(calls) < 3:
            raise ConflictError("lost the CAS")

    await bus.publish(subjects.claim("t", "c3", "release"), release("c3"))
    async def acked() -> bool:
        return len(calls) >= 3 and await settled(bus)

    await run_consumer(bus, handler, acked)
    assert calls == [1, 1, 1]  # same delivery, retried in place
    info = await bus.consumer_info(subjects.STREAM_CLAIMS, "probe")
    assert info.num_ack_pending == 0 and info.num_redelivered == 0


async def test_temporary_error_is_redelivered_then_dead_lettered_at_max_deliver(bus):
    calls = []

    async def handler(event, delivery):
        calls.append(delivery.num_delivered)
        raise TemporaryError("peer down", delay=0.05)

    await bus.publish(subjects.claim("t", "c4", "release"), release("c4"))
    async def lettered() -> bool:
        return len(calls) >= 3 and bool(await dlq(bus))

    await run_consumer(bus, handler, lettered)
    assert calls == [1, 2, 3]
    letters = await dlq(bus)
    assert len(letters) == 1 and "gave up after 3 deliveries" in letters[0].reason
    assert letters[0].service == "test" and "c4" in letters[0].subject


async def test_permanent_error_and_bad_payload_go_to_dead_letter_once(bus):
    calls = []

    async def handler(event, delivery):
        calls.append(event.claim)
        raise PermanentError("tenant is gone")

    await bus.publish(subjects.claim("t", "c5", "release"), release("c5"))
    await bus.publish_bytes(subjects.claim("t", "c6", "release"), b'{"kind": "release", "claim": 7}')

    async def both_lettered() -> bool:
        return len(await dlq(bus)) >= 2

    await run_consumer(bus, handler, both_lettered)
    letters = await dlq(bus)
    reasons = sorted(letter.reason for letter in letters)
    assert len(letters) == 2 and calls == ["c5"]
    assert any("tenant is gone" in r for r in reasons)
    assert any("invalid payload" in r and "$.claim" in r for r in reasons)
    payload = [letter.payload for letter in letters if "c6" in letter.subject][0]
    assert msgspec.json.decode(payload)["claim"] == 7


def test_urls_in_logs_never_carry_credentials():
    from tessera.shared.bus import redact

    assert redact("nats://platform:s3cret@10.0.0.1:4222") == "nats://***@10.0.0.1:4222"
    assert redact("nats://127.0.0.1:4222") == "nats://127.0.0.1:4222"


async def test_a_message_fetched_as_its_consumer_stops_neither_blocks_the_drain_nor_is_lost(bus, caplog):
    """A pull request still open when its consumer is cancelled gets the next message into a queue
    nobody reads; draining used to wait on that queue until its timeout (every service's stop, and
    every system test's teardown, took 5 s more). The message is redelivered to whoever comes next."""
    seen = []

    async def handler(event, delivery):
        seen.append(event.claim)

    task = asyncio.create_task(bus.consume(Subscription(
        stream=subjects.STREAM_CLAIMS, durable="probe", filter_subjects=[subjects.claims_of_kind("release")],
        decoder=claim_decoder, handler=handler,
    )))
    await eventually(lambda: pull_request_open(bus, "probe"), every=0.02, what="the consumer's pull request open")
    await cancel_and_wait([task])
    await bus.publish(subjects.claim("t", "c9", "release"), release("c9"))
    info = await bus.consumer_info(subjects.STREAM_CLAIMS, "probe")
    assert seen == [] and info.num_ack_pending + info.num_pending == 1

    with caplog.at_level("WARNING", logger="tessera.bus"):
        await bus.close()
    assert not [r for r in caplog.records if "drain" in r.getMessage()], caplog.text

    later = await Bus.connect(BusSettings(url=bus.settings.url, max_deliver=3, ack_wait=2), "test")
    try:
        await run_consumer(later, handler, lambda: seen)
        assert seen == ["c9"]
    finally:
        await later.close()
