"""Every log line names the trace and span it was written in: a line a handler logs carries the ids
of that handler's span (the one exported over OTLP), a line outside any span says ``-``, and without
an exporter a line still carries the trace of the message being handled. Through the runner's own
log handler and a real nats-server."""

from __future__ import annotations

import asyncio
import io
import logging
import re

import pytest

from tessera.shared import subjects
from tessera.shared.bus import Bus, Subscription
from tessera.shared.cancelling import cancel_and_wait
from tessera.shared.events import ClaimReleaseRequested, claim_decoder, encode
from tessera.shared.runner import log_handler
from tessera.shared.settings import BusSettings
from tessera.shared.telemetry import Telemetry

LINE = re.compile(r"^\S+ \S+ probe (?P<level>\w+) (?P<logger>\S+) trace=(?P<trace>\S+) span=(?P<span>\S+): (?P<msg>.*)$")
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def log_lines():
    """What the runner's handler writes for the ``tessera.probe`` logger, as parsed lines."""
    out = io.StringIO()
    handler = log_handler("probe", out)
    logger = logging.getLogger("tessera.probe")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lambda: [LINE.match(line).groupdict() for line in out.getvalue().splitlines()]
    finally:
        logger.removeHandler(handler)


async def handle_one(nats_url, telemetry: Telemetry, headers: dict[str, str] | None = None) -> None:
    """Publish one release (with ``headers`` as sent, or the bus's own) and let a consumer whose
    handler logs a line handle it."""
    bus = await Bus.connect(BusSettings(url=nats_url), "probe", telemetry)
    await bus.ensure_topology()
    handled = asyncio.Event()

    async def handler(event, delivery):
        logging.getLogger("tessera.probe").info("releasing %s", event.claim)
        handled.set()

    subject = subjects.claim("acme", "c-1", "release")
    event = ClaimReleaseRequested(claim="c-1", tenant="acme")
    if headers is None:
        await bus.publish(subject, event)
    else:
        await bus.publish_bytes(subject, encode(event), headers=headers)
    task = asyncio.create_task(bus.consume(Subscription(stream=subjects.STREAM_CLAIMS, durable="probe",
                                                        filter_subjects=[subjects.claims_of_kind("release")],
                                                        decoder=claim_decoder, handler=handler)))
    try:
        async with asyncio.timeout(15):
            await handled.wait()
    finally:
        await cancel_and_wait([task])
        await bus.close()


async def test_a_line_logged_in_a_handler_carries_the_ids_of_the_handlers_exported_span(nats_url, otlp_collector,
                                                                                       log_lines):
    telemetry = Telemetry("probe", otlp_collector.endpoint)
    try:
        await handle_one(nats_url, telemetry)
    finally:
        telemetry.shutdown()  # flushes
    [line] = [line for line in log_lines() if line["msg"] == "releasing c-1"]
    [span] = [s for s in otlp_collector.spans if s["name"] == "probe handle release"]
    assert (line["trace"], line["span"]) == (span["trace_id"], span["span_id"])
    assert re.fullmatch(r"[0-9a-f]{32}", line["trace"]) and re.fullmatch(r"[0-9a-f]{16}", line["span"])


def test_a_line_logged_outside_any_span_says_so(log_lines):
    logging.getLogger("tessera.probe").warning("starting")
    [line] = log_lines()
    assert (line["level"], line["logger"], line["trace"], line["span"], line["msg"]) == \
        ("WARNING", "tessera.probe", "-", "-", "starting")


async def test_without_an_exporter_a_handlers_line_carries_the_trace_of_its_message(nats_url, log_lines):
    await handle_one(nats_url, Telemetry("probe", None), headers={"traceparent": PARENT})
    [line] = [line for line in log_lines() if line["msg"] == "releasing c-1"]
    # No span of this service is exported, so the line names the message's own: that is where
    # the trace, as a tracing backend shows it, continues.
    assert (line["trace"], line["span"]) == ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")
