"""Trace context through a service with and without an exporter."""

from __future__ import annotations

from tessera.shared.telemetry import Telemetry, current_trace_id, inject

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_without_an_exporter_the_incoming_trace_context_is_passed_on_unchanged():
    telemetry = Telemetry("probe", None)
    with telemetry.span("handle", parent_headers={"traceparent": PARENT}):
        assert current_trace_id() == "0af7651916cd43dd8448eb211c80319c"
        assert inject({})["traceparent"] == PARENT
    assert current_trace_id() == ""  # and the context is left as it was


def test_without_an_exporter_a_message_with_no_context_still_starts_a_trace():
    telemetry = Telemetry("probe", None)
    with telemetry.span("handle", parent_headers={}):
        header = inject({})["traceparent"]
    version, trace_id, span_id, flags = header.split("-")
    assert version == "00" and int(trace_id, 16) and int(span_id, 16) and int(flags, 16) & 1  # sampled


def test_with_an_exporter_each_hop_gets_its_own_span_in_the_same_trace(otlp_collector):
    telemetry = Telemetry("probe", otlp_collector.endpoint)
    try:
        with telemetry.span("handle", parent_headers={"traceparent": PARENT}):
            header = inject({})["traceparent"]
        assert header.split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
        assert header.split("-")[2] != "b7ad6b7169203331"
    finally:
        telemetry.shutdown()  # flushes
    [span] = otlp_collector.spans
    assert span["parent_span_id"] == "b7ad6b7169203331" and span["span_id"] == header.split("-")[2]
