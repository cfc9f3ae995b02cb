"""OpenTelemetry set-up and W3C trace-context propagation through NATS headers.

One claim is one trace: every publish carries a ``traceparent`` header taken from the current span,
and every handler runs in a span whose parent is extracted from the incoming message. Spans are
exported over OTLP/HTTP when an endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT``, e.g. Jaeger's
collector on :4318). Without one nothing is exported and no span is built: a message that already
carries a trace context passes its ``traceparent`` on unchanged, so the trace stays whole, and one that
carries none starts a trace with fresh ids (for the services downstream that do export).

The span attributes every service sets on a claim's spans are named here, once (``CLAIM`` …
``DEAD_LETTER``; `claim_attributes` reads them off an event or record), and so is the log filter
that stamps each log line with the trace and span it was written in (`TraceIdsFilter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from tessera.shared.errors import ConflictError
from tessera.shared.events import DeviceShare

_PROPAGATOR = TraceContextTextMapPropagator()
_IDS = RandomIdGenerator()

# --- the attributes of a claim's spans (documented in docs/observability.md) ---------------------

CLAIM = "tessera.claim"  # the claim id
TENANT = "tessera.tenant"  # the tenant that owns it
NODE = "tessera.node"  # the node it is on (or placed on)
DEVICES = "tessera.devices"  # its GPU shares: "<index>:<uuid>:<memory MiB>MiB:<cores>%" each
POLICY = "tessera.policy"  # placement's policy for it: "<node policy>/<gpu policy>"
DECISION = "tessera.decision"  # what the span's service decided: allocated, unschedulable, prepared, ...
DECISION_REASON = "tessera.decision.reason"  # why (a refusal's reason; empty when there is none)
DEAD_LETTER = "tessera.dead_letter"  # the reason the message was dead-lettered (only then)

CLAIM_ATTRIBUTES = (CLAIM, TENANT, NODE, DEVICES, POLICY, DECISION, DECISION_REASON, DEAD_LETTER)


def devices_attribute(devices) -> list[str]:
    """``tessera.devices`` for a list of `DeviceShare` (anything else in it is left out)."""
    return [f"{d.index}:{d.uuid}:{d.memory_mib}MiB:{d.cores}%" for d in devices if isinstance(d, DeviceShare)]


def claim_attributes(item: object) -> dict[str, AttributeValue]:
    """The claim attributes an event or record carries (claim, tenant, node, devices), by field
    name: any Struct with those fields, so a new claim event needs nothing here. A node of ``_``
    (none yet) and empty lists are left out."""
    attrs: dict[str, AttributeValue] = {}
    claim = getattr(item, "claim", None)
    if not isinstance(claim, str) or not claim:
        return attrs
    attrs[CLAIM] = claim
    tenant = getattr(item, "tenant", None)
    if isinstance(tenant, str) and tenant:
        attrs[TENANT] = tenant
    node = getattr(item, "node", None)
    if isinstance(node, str) and node and node != "_":
        attrs[NODE] = node
    devices = devices_attribute(getattr(item, "devices", None) or ())
    if devices:
        attrs[DEVICES] = devices
    return attrs


def decided(item: object, decision: str, reason: str = "", *, span: Span | None = None,
            **extra: AttributeValue | None) -> None:
    """What the handling of ``item`` (an event or record) came to, on ``span`` (the current span
    by default): its claim attributes, ``tessera.decision`` and ``tessera.decision.reason``, and
    ``extra`` attributes (names above). Costs nothing on a span that records nothing."""
    span = span or trace.get_current_span()
    if not span.is_recording():
        return
    attrs = claim_attributes(item)
    attrs[DECISION] = decision
    attrs[DECISION_REASON] = reason
    attrs.update((k, v) for k, v in extra.items() if v not in (None, "", [], ()))
    span.set_attributes(attrs)


def failed(span: Span, exc: BaseException, *, dead_letter: str | None = None) -> None:
    """End-of-handling verdict on ``span``: ERROR with the exception recorded as an event, and
    ``tessera.dead_letter`` when the message was dead-lettered. A no-op on a span that records nothing."""
    if not span.is_recording():
        return
    span.record_exception(exc)
    if dead_letter is not None:
        span.set_attribute(DEAD_LETTER, dead_letter)
    span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


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
        attributes: Mapping[str, AttributeValue] | None = None,
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
            name, context=ctx, kind=kind, attributes=dict(attributes or {}),
            record_exception=False, set_status_on_exception=False,
        ) as sp:
            try:
                yield sp
            except (ConflictError, asyncio.CancelledError):
                raise  # a lost compare-and-set is retried, a cancelled task is stopping: neither failed
            except BaseException as exc:
                failed(sp, exc)
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


class TraceIdsFilter(logging.Filter):
    """Adds ``trace_id`` and ``span_id`` (hex; ``-`` outside any span) to every record that passes
    the handler it is attached to, so a log line can be found from its trace and back.

    It only reads the current context (a contextvar) and never fails a record: a record that
    already carries ids (made in another thread and handed over) keeps them."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "trace_id"):
            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                record.trace_id = format(ctx.trace_id, "032x")
                record.span_id = format(ctx.span_id, "016x")
            else:
                record.trace_id = record.span_id = "-"
        return True
