"""`Bus.publish_many` takes `Outgoing` items: the message id dedupes, headers captured earlier
replace the current trace context, and anything else is refused saying what to write — against a
real nats-server."""

from __future__ import annotations

import pytest

from tessera.shared import subjects
from tessera.shared.bus import BatchSubscription, Bus, Outgoing, Subscription
from tessera.shared.events import ClaimReleaseRequested, claim_decoder, encode
from tessera.shared.settings import BusSettings

CAPTURED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
async def bus(nats_url):
    b = await Bus.connect(BusSettings(url=nats_url), "test")
    await b.ensure_topology()
    yield b
    await b.close()


async def test_outgoing_items_are_stored_once_each_with_the_headers_they_name(bus):
    release = ClaimReleaseRequested(claim="c1", tenant="t")
    subject = subjects.claim("t", "c1", "release")
    with bus.telemetry.span("origin") as origin:
        acks = await bus.publish_many([
            Outgoing(subject, release, "c1:release"),
            Outgoing(subject, release, "c1:release"),  # the same id: deduplicated
            Outgoing(subjects.claim("t", "c2", "release"), ClaimReleaseRequested(claim="c2", tenant="t"),
                     "c2:release", headers={"traceparent": CAPTURED}),
        ])
        trace_id = format(origin.get_span_context().trace_id, "032x")
    assert [a.duplicate for a in acks] == [False, True, False]
    first = await bus.stored_message(subjects.STREAM_CLAIMS, acks[0].seq)
    assert first.data == encode(release) and first.headers["Nats-Msg-Id"] == "c1:release"
    assert first.headers["traceparent"].split("-")[1] == trace_id  # the current span's
    captured = await bus.stored_message(subjects.STREAM_CLAIMS, acks[2].seq)
    assert captured.headers == {"traceparent": CAPTURED, "Nats-Msg-Id": "c2:release"}


async def test_a_tuple_is_refused_saying_what_to_write(bus):
    with pytest.raises(TypeError, match=r"publish_many takes Outgoing items, got tuple.*Outgoing\(subject, event, msg_id\)"):
        await bus.publish_many([(subjects.claim("t", "c1", "release"), ClaimReleaseRequested(claim="c1", tenant="t"),
                                 "c1:release")])


async def test_a_subscription_handed_to_the_other_method_is_refused_saying_which(bus):
    async def one(event, delivery) -> None:
        return None

    what = dict(stream=subjects.STREAM_CLAIMS, durable="probe", filter_subjects=[subjects.claims_of_kind("release")],
                decoder=claim_decoder, handler=one)
    with pytest.raises(TypeError, match="a BatchSubscription goes to consume_batches"):
        await bus.consume(BatchSubscription(**what))
    with pytest.raises(TypeError, match="a Subscription goes to consume$"):
        await bus.consume_batches(Subscription(**what))
