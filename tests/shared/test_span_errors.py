"""A handler that fails ends its span with ERROR, the exception recorded on it; a message that is
dead-lettered says so and why on its span — through the bus boundary, against a real nats-server,
with the spans received over real OTLP."""

from __future__ import annotations

import asyncio

import pytest

from tessera.shared import subjects
from tessera.shared.bus import BatchSubscription, Bus, Subscription
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.errors import PermanentError, TemporaryError
from tessera.shared.events import ClaimReleaseRequested, claim_decoder
from tessera.shared.settings import BusSettings
from tessera.shared.telemetry import Telemetry

from kit import eventually
from test_bus_delivery import dlq


@pytest.fixture
async def traced(nats_url, otlp_collector):
    """A bus whose spans go to the test's OTLP receiver; ``spans()`` flushes and returns them."""
    telemetry = Telemetry("probe", otlp_collector.endpoint)
    bus = await Bus.connect(BusSettings(url=nats_url, max_deliver=3, ack_wait=2), "test", telemetry)
    await bus.ensure_topology()

    def spans() -> list[dict]:
        telemetry.provider.force_flush()
        with otlp_collector.lock:
            return [s for s in otlp_collector.spans if s["name"].startswith("test ")]

    try:
        yield bus, spans
    finally:
        await bus.close()
        telemetry.shutdown()


async def consume(bus: Bus, until, *, handler=None, batch_handler=None, timeout=15.0) -> None:
    what = dict(stream=subjects.STREAM_CLAIMS, durable="probe", filter_subjects=[subjects.claims_of_kind("release")],
                decoder=claim_decoder)
    task = asyncio.create_task(
        bus.consume_batches(BatchSubscription(**what, handler=batch_handler)) if batch_handler is not None
        else bus.consume(Subscription(**what, handler=handler)))
    try:
        await eventually(until, timeout=timeout, every=0.05)
        # the verdict (ack or termination) of the message in hand reaches the server before the cancel
        await eventually(lambda: settled(bus), timeout=timeout, every=0.05)
    finally:
        await cancel_and_wait([task])


async def settled(bus: Bus) -> bool:
    info = await bus.consumer_info(subjects.STREAM_CLAIMS, "probe")
    return info.num_ack_pending == 0 and info.num_pending == 0


async def spans_named(spans, name: str, count: int) -> list[dict]:
    """The spans called ``name`` once there are ``count`` of them (a span ends after its verdict)."""
    def found() -> list[dict] | None:
        named = [s for s in spans() if s["name"] == name]
        return named if len(named) >= count else None

    return await eventually(found, timeout=15, what=f"{count} spans {name!r}")


async def test_a_raising_handler_ends_its_span_with_error_and_the_retry_that_succeeds_does_not(traced):
    bus, spans = traced
    calls = []

    async def handler(event, delivery):
        calls.append(delivery.num_delivered)
        if len(calls) == 1:
            raise ValueError("the node directory is not writable")

    await bus.publish(subjects.claim("acme", "c-1", "release"), ClaimReleaseRequested(claim="c-1", tenant="acme"))

    async def twice():
        return len(calls) >= 2

    await consume(bus, twice, handler=handler)
    first, second = _in_order(await spans_named(spans, "test handle release", 2))
    assert first["status"] == "STATUS_CODE_ERROR"
    assert "ValueError" in first["status_message"] and "not writable" in first["status_message"]
    [event] = first["events"]
    assert event["name"] == "exception"
    assert event["attributes"]["exception.type"] == "ValueError"
    assert "tessera.dead_letter" not in first["attributes"]  # retried, not dead-lettered
    assert second["status"] != "STATUS_CODE_ERROR" and not second["events"]
    for span in (first, second):
        assert span["attributes"]["tessera.claim"] == "c-1" and span["attributes"]["tessera.tenant"] == "acme"


def _in_order(handled: list[dict]) -> list[dict]:
    """The handling spans of one message, first delivery first (each is its own span)."""
    assert len(handled) >= 2, handled
    errors = [s for s in handled if s["status"] == "STATUS_CODE_ERROR"]
    fine = [s for s in handled if s["status"] != "STATUS_CODE_ERROR"]
    assert len(errors) == 1 and len(fine) == 1, handled
    return [errors[0], fine[0]]


async def test_a_dead_lettered_message_ends_its_span_with_error_and_the_reason(traced):
    bus, spans = traced

    async def handler(event, delivery):
        raise PermanentError("claim c-2 belongs to tenant 'other'")

    await bus.publish(subjects.claim("acme", "c-2", "release"), ClaimReleaseRequested(claim="c-2", tenant="acme"))

    async def lettered():
        return len(await dlq(bus)) == 1

    await consume(bus, lettered, handler=handler)
    [span] = await spans_named(spans, "test handle release", 1)
    assert span["status"] == "STATUS_CODE_ERROR"
    assert span["attributes"]["tessera.dead_letter"] == "claim c-2 belongs to tenant 'other'"
    assert span["attributes"]["tessera.claim"] == "c-2"
    assert [e["attributes"]["exception.type"] for e in span["events"]] == ["tessera.shared.errors.PermanentError"]


async def test_a_message_that_spends_max_deliver_is_dead_lettered_on_its_last_span(traced):
    bus, spans = traced
    calls = []

    async def handler(event, delivery):
        calls.append(delivery.num_delivered)
        raise TemporaryError("peer down", delay=0.05)

    await bus.publish(subjects.claim("acme", "c-3", "release"), ClaimReleaseRequested(claim="c-3", tenant="acme"))

    async def lettered():
        return len(await dlq(bus)) == 1

    await consume(bus, lettered, handler=handler)
    handled = await spans_named(spans, "test handle release", 3)
    assert len(handled) == 3 and all(s["status"] == "STATUS_CODE_ERROR" for s in handled)
    letters = [s["attributes"].get("tessera.dead_letter") for s in handled]
    assert sorted(letters, key=bool) == [None, None, "gave up after 3 deliveries: peer down"]


async def test_a_batch_handlers_dead_letter_gets_an_error_span_in_the_messages_trace(traced):
    bus, spans = traced
    telemetry = bus.telemetry

    async def batch_handler(items):
        return [PermanentError(f"{event.claim}: no such tenant") for event, _ in items]

    with telemetry.span("test origin") as origin:
        await bus.publish(subjects.claim("acme", "c-4", "release"), ClaimReleaseRequested(claim="c-4", tenant="acme"))
        origin_ids = format(origin.get_span_context().trace_id, "032x"), format(origin.get_span_context().span_id, "016x")

    async def lettered():
        return len(await dlq(bus)) == 1

    await consume(bus, lettered, batch_handler=batch_handler)
    [span] = await spans_named(spans, "test dead-letter release", 1)
    assert span["status"] == "STATUS_CODE_ERROR"
    assert span["attributes"]["tessera.dead_letter"] == "c-4: no such tenant"
    assert span["attributes"]["tessera.claim"] == "c-4" and span["attributes"]["tessera.tenant"] == "acme"
    assert (span["trace_id"], span["parent_span_id"]) == origin_ids
