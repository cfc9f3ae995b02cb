"""OpenTelemetry set-up and W3C trace-context propagation through NATS headers.

One claim is one trace: every publish carries a ``traceparent`` header taken from the current span,
and every handler runs in a span whose parent is extracted from the incoming message. Spans are
exported over OTLP/HTTP when an endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT``, e.g. Jaeger's
collector on :4318). Without one nothing is exported and no span is built: a message that already
carries a trace context passes its ``traceparent`` on unchanged, so the trace stays whole, and one that
carries none starts a trace with fresh ids (for the services downstream that do export).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_IDS = RandomIdGenerator()


class Telemetry:
    """A tracer provider owned by one service process; ``shutdown`` flushes pending spans."""

    def __init__(self, service: str, otlp_endpoint: str | None, instance: str = "") -> None:
        attrs = {"service.name": f"tessera-{service}"}
        if instance:
            attrs["service.instance.id"] = instance
        self.provider = TracerProvider(resource=Resource.create(attrs))
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            url = otlp_endpoint.rstrip("/")
            if not url.endswith("/v1/traces"):
                url += "/v1/traces"
            self.provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=url), schedule_delay_millis=500)
            )
        self.tracer = self.provider.get_tracer("tessera")
        # Without an exporter a span of ours would never be seen: a message that already carries a
        # trace context is handled in that context and passes it on unchanged (downstream spans then
        # hang off the last span that *was* exported, not off one that never existed), which also
        # spares the hot paths the cost of building spans. A message without one still starts a trace.
        self.exporting = bool(otlp_endpoint)

    def shutdown(self) -> None:
        self.provider.shutdown()

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        *,
        parent_headers: Mapping[str, str] | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, object] | None = None,
    ) -> Iterator[Span]:
        """A span; when ``parent_headers`` carry a traceparent, the span continues that trace."""
        ctx = extract(parent_headers) if parent_headers is not None else None
        if not self.exporting:
            parent = trace.get_current_span(ctx)
            if not parent.get_span_context().is_valid:
                # A trace starts here, but its first span would never be seen: only its ids are made.
                parent = NonRecordingSpan(SpanContext(
                    trace_id=_IDS.generate_trace_id(), span_id=_IDS.generate_span_id(), is_remote=False,
                    trace_flags=TraceFlags(TraceFlags.SAMPLED)))
                ctx = trace.set_span_in_context(parent, ctx)
            token = otel_context.attach(ctx) if ctx is not None else None
            try:
                yield parent
            finally:
                if token is not None:
                    otel_context.detach(token)
            return
        with self.tracer.start_as_current_span(
            name, context=ctx, kind=kind, attributes=dict(attributes or {})
        ) as sp:
            try:
                yield sp
            except BaseException as exc:
                sp.set_status(Status(StatusCode.ERROR, str(exc)))
                raise


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Add the current span's ``traceparent`` (and ``tracestate``) to ``headers``."""
    headers = {} if headers is None else headers
    _PROPAGATOR.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return _PROPAGATOR.extract(dict(headers or {}))


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
