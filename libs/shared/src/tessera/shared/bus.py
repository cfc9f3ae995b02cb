"""The one module that talks to NATS: connection, topology, publish, consume, KV, request/reply.

Delivery is at least once, so correctness comes from the rules this module applies everywhere:
every publish carries a ``Nats-Msg-Id`` (deduplicated by the stream) and a W3C ``traceparent``;
consumers are durable pull consumers with an explicit ``max_deliver``; what a handler raises decides
the fate of the message (see tessera.shared.errors): terminate + dead-letter, redeliver later, or
retry now. Streams and buckets are created in one place, with production settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Mapping
from urllib.parse import urlsplit

import msgspec
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry.trace import SpanKind

from tessera.shared import api as api_replies
from tessera.shared import identities, subjects, topology
from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.events import DeadLetter, encode
from tessera.shared.jspub import PubAck, PublishError, not_now, publisher
from tessera.shared.settings import BusSettings
from tessera.shared.telemetry import Telemetry, claim_attributes, failed, inject

log = logging.getLogger("tessera.bus")

# How long a closing bus lets in-flight acks and publishes finish before it closes the connection.
DRAIN_SECONDS = 5.0

__all__ = [
    "Bus",
    "Delivery",
    "KeyNotFoundError",
    "KeyWrongLastSequenceError",
    "KeyValue",
]

CONFLICT_RETRIES = 50
# A handler still running after this fraction of ack_wait tells the server it is working on the
# message (``+WPI``), so the server does not redeliver it to a peer meanwhile.
PROGRESS_FRACTION = 1 / 3
# ... but not forever: a handler this many ack_waits into one batch is presumed stuck, and the
# server may give its messages to a peer (at-least-once, so a late finish is harmless).
PROGRESS_LIMIT = 10
# Where the server announces a message it stopped delivering because max_deliver was spent.
MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


class _Exhausted(msgspec.Struct):
    """The fields of the server's max-deliveries advisory that the bus reads."""

    stream: str = ""
    stream_seq: int = 0
    deliveries: int = 0


_exhausted = msgspec.json.Decoder(_Exhausted)


@dataclass(frozen=True)
class Delivered:
    """What a claim event's subject says of it, for a span when its payload is not at hand."""

    claim: str
    tenant: str
    node: str


@dataclass(frozen=True)
class Delivery:
    """What a handler may want to know about the message besides its decoded event."""

    subject: str
    headers: Mapping[str, str]
    data: bytes
    num_delivered: int


Handler = Callable[[Any, Delivery], Awaitable[None]]
BatchHandler = Callable[[list[tuple[Any, Delivery]]], Awaitable[list[BaseException | None]]]
ApiHandler = Callable[[bytes, Mapping[str, str]], Awaitable[bytes]]


def redact(url: str) -> str:
    """A NATS URL (or a comma-separated list of them) fit for logs: credentials replaced by ***."""
    if "," in url:
        return ",".join(redact(u.strip()) for u in url.split(","))
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


RELOAD_GRACE = 3.0  # seconds a JetStream request waits out a server reload


def ride_out_reloads(nc: NatsClient) -> None:
    """Retry JetStream requests that find no responder while nats-server reloads its accounts.

    With accounts in the config (one per tenant: `tessera.shared.identities`), every reload (each
    tenant created or deleted) re-registers each account's JetStream API, and for ~0.2 s requests
    to it get "JetStream not enabled for account" or no responder, and so do publishes to streams
    (nats-py: ServiceUnavailableError, NoStreamResponseError). Nothing was stored, so sending again is safe (stream publishes carry
    message ids as well). The request/reply APIs (``tessera.api.*``) are not retried: there "no
    responders" means the service is not running, and callers say so at once."""
    plain = nc.request

    async def request(subject: str, payload: bytes = b"", timeout: float = 0.5, old_style: bool = False,
                      headers: dict[str, Any] | None = None):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RELOAD_GRACE
        while True:
            try:
                msg = await plain(subject, payload, timeout=timeout, old_style=old_style, headers=headers)
            except nats.errors.NoRespondersError:
                if subject.startswith(f"{subjects.API}.") or loop.time() > deadline:
                    raise
            else:
                # "JetStream not enabled for account" (503, err_code 10039) while it is re-enabled.
                if not (subject.startswith("$JS.API.") and b'"err_code":10039' in msg.data) or loop.time() > deadline:
                    return msg
            await asyncio.sleep(0.02)

    nc.request = request  # type: ignore[method-assign]


class Bus:
    def __init__(self, nc: NatsClient, settings: BusSettings, service: str, telemetry: Telemetry):
        self.nc = nc
        self.js = nc.jetstream()
        self.settings = settings
        self.service = service
        self.telemetry = telemetry
        self._kv: dict[str, KeyValue] = {}
        self.consumers: dict[tuple[str, str], None] = {}  # (stream, durable) this process consumes
        self.declared = topology.declare(settings.topology())  # the streams and buckets, with their limits

    # --- connection ------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        settings: BusSettings,
        service: str,
        telemetry: Telemetry | None = None,
        *,
        connect_timeout: float = 5.0,
    ) -> "Bus":
        shown = redact(settings.url)
        state = {"closing": False}

        async def on_error(exc: Exception) -> None:
            log.warning("nats: %s", exc)

        async def on_disconnect() -> None:
            if not state["closing"]:
                log.warning("nats: disconnected from %s", shown)

        async def on_reconnect() -> None:
            log.info("nats: reconnected to %s", shown)

        options: dict[str, Any] = dict(
            servers=settings.servers,
            name=f"tessera-{service}",
            connect_timeout=connect_timeout,
            max_reconnect_attempts=settings.max_reconnect_attempts,
            reconnect_time_wait=settings.reconnect_time_wait,
            allow_reconnect=True,
            drain_timeout=DRAIN_SECONDS,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
        if settings.creds_file:
            options["user_credentials"] = settings.creds_file
        if settings.user:
            options.update(user=settings.user, password=settings.password or "")
        user = settings.user or urlsplit(settings.servers[0]).username
        if user:  # replies to this identity only: its permissions allow no other inbox
            options["inbox_prefix"] = identities.inbox_prefix(user)
        try:
            nc = await nats.connect(**options)
        except Exception as exc:  # nats raises several unrelated types for "cannot connect"
            raise TemporaryError(f"cannot connect to NATS at {shown}: {exc}") from exc
        ride_out_reloads(nc)
        bus = cls(nc, settings, service, telemetry or Telemetry(service, None))
        bus._state = state
        return bus

    async def close(self) -> None:
        """Drain: finish in-flight handlers' acks and publishes, then close."""
        getattr(self, "_state", {})["closing"] = True
        if self.nc.is_closed:
            return
        try:  # past DRAIN_SECONDS nats-py reports DrainTimeoutError (logged by on_error) and closes
            await asyncio.wait_for(self.nc.drain(), timeout=DRAIN_SECONDS + 5)
        except Exception:  # already disconnected, or the drain itself stuck: close regardless
            await self.nc.close()

    # --- topology --------------------------------------------------------------------------

    async def ensure_topology(self) -> dict[str, str]:
        """Make the server hold the streams and KV buckets this service uses (its identity may touch
        no others: `tessera.shared.identities`) as `tessera.shared.topology` declares them: created
        when missing, replicas and limits updated when they differ; every one for a tool with no
        entry there. Only services (and tests acting as them) call this; readers only bind."""
        streams, buckets = identities.topology(self.service)
        return await topology.ensure(self.js, self.declared, streams, buckets)

    async def kv(self, bucket: str) -> KeyValue:
        """Bind to an existing bucket; `topology.TopologyMissing` (start the services first) when absent."""
        kv = self._kv.get(bucket)
        if kv is None:
            kv = self._kv[bucket] = await topology.bind(self.js, bucket)
        return kv

    # --- publishing ------------------------------------------------------------------------

    def _headers(self, msg_id: str | None) -> dict[str, str]:
        headers = inject({})
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        return headers

    async def publish(self, subject: str, event: msgspec.Struct, *, msg_id: str | None = None) -> api.PubAck:
        try:
            return await self.js.publish(subject, encode(event), headers=self._headers(msg_id), timeout=5)
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError, nats.js.errors.NoStreamResponseError) as exc:
            raise TemporaryError(f"publish to {subject} failed: {exc!r}") from exc
        except nats.js.errors.APIError as exc:
            if not_now(exc.code or 0, exc.err_code or 0):
                raise TemporaryError(f"publish to {subject} not taken yet ({exc.description}); retry later") from exc
            raise

    async def publish_many(self, items: Iterable[tuple]) -> list[PubAck]:
        """Publish without waiting for each ack in turn, then gather the acks (much faster).

        Items are ``(subject, event, msg_id)``, or ``(subject, event, msg_id, headers)`` where
        ``headers`` carries a traceparent captured earlier (when the publish happens outside the
        span that decided it). Raises the first failure after every item has been tried."""
        batch = []
        for item in items:
            subject, event, msg_id = item[:3]
            if len(item) > 3:
                headers = dict(item[3])
                if msg_id:
                    headers["Nats-Msg-Id"] = msg_id
            else:
                headers = self._headers(msg_id)
            batch.append((subject, encode(event), headers))
        acks = await publisher(self.nc).publish(batch)
        for ack in acks:
            if isinstance(ack, PublishError) and ack.not_now:
                raise TemporaryError(f"{ack}: not taken yet; retry later") from ack
            if isinstance(ack, Exception):
                raise ack
        return acks

    async def stored(self, stream: str, subject: str) -> bool:
        """Whether ``stream`` holds a message on exactly ``subject`` (a reconciler asking whether an
        event it owes was ever published)."""
        try:
            await self.js.get_last_msg(stream, subject)
            return True
        except NotFoundError:
            return False
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError) as exc:
            raise TemporaryError(f"cannot read {stream} for {subject}: {exc!r}") from exc

    async def follow(self, subject: str, decoder: msgspec.json.Decoder,
                     on_event: Callable[[Any, Mapping[str, str]], Awaitable[None] | None]) -> None:
        """Watch ``subject`` on core NATS (no storage, no acks) and hand each event and its headers
        to ``on_event``; runs until cancelled. For signs of life and hints that every replica
        follows: what does not decode is skipped here (the streams' consumers dead-letter it)."""
        sub = await self.nc.subscribe(subject)
        try:
            async for msg in sub.messages:
                try:
                    event = decoder.decode(msg.data)
                except (msgspec.ValidationError, msgspec.DecodeError):
                    continue
                done = on_event(event, msg.headers or {})
                if done is not None:
                    await done
        finally:
            await sub.unsubscribe()

    async def dead_letter(self, subject: str, data: bytes, reason: str, deliveries: int = 1, *,
                          stream: str = "", seq: int = 0) -> None:
        """Publish a letter for the message at ``seq`` of ``stream``. The message id is its stream
        position, so a message dead-lettered again (redelivered before its terminate arrived, or
        both by its last handler and by the max-deliveries watch) leaves one letter."""
        letter = DeadLetter(
            service=self.service,
            subject=subject,
            reason=reason,
            payload=data.decode("utf-8", errors="replace"),
            deliveries=deliveries,
            stream=stream,
        )
        log.error("dead-letter %s: %s", subject, reason)
        msg_id = f"dlq:{stream}:{seq}" if stream and seq else None
        await self.publish(subjects.dlq(self.service), letter, msg_id=msg_id)

    async def watch_exhausted(self, stream: str, durable: str) -> None:
        """Dead-letter what the server stops delivering on ``durable`` because ``max_deliver`` is
        spent with no verdict (each delivery's handler died or outran ack_wait); runs until
        cancelled. Every replica watches; the letters' message ids make it one letter."""

        async def on_advisory(msg: Msg) -> None:
            try:
                advisory = _exhausted.decode(msg.data)
                try:
                    stored = await self.js.get_msg(stream, advisory.stream_seq)
                    subject, data, headers = stored.subject or "", stored.data or b"", dict(stored.headers or {})
                except NotFoundError:  # aged out of the stream meanwhile: the letter says where it was
                    subject, data, headers = "", b"", {}
                reason = f"gave up after {advisory.deliveries} deliveries: no delivery was settled (max_deliver spent)"
                await self.dead_letter(subject, data, reason, advisory.deliveries, stream=stream,
                                       seq=advisory.stream_seq)
                self._letter_span(Delivery(subject, headers, data, advisory.deliveries), None,
                                  PermanentError(reason), reason)
            except Exception as exc:  # the next replica's watch, or the operator's log, has it
                log.error("cannot dead-letter an exhausted message of %s/%s: %r", stream, durable, exc)

        sub = await self.nc.subscribe(MAX_DELIVERIES_ADVISORY.format(stream=stream, consumer=durable),
                                      cb=on_advisory)
        try:
            await asyncio.Event().wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    @contextlib.asynccontextmanager
    async def _progress(self, msgs: list[Msg]):
        """While the body runs, tell the server every fraction of ack_wait that ``msgs`` are still
        being worked on, so a slow handler or batch is not redelivered to a peer. A timer, not a
        task: the common batch ends long before the first beat and costs one timer."""
        loop = asyncio.get_running_loop()
        period = max(self.settings.ack_wait * PROGRESS_FRACTION, 0.05)
        beats = int(PROGRESS_LIMIT / PROGRESS_FRACTION)
        state: dict[str, Any] = {"beat": 0, "task": None}

        async def beat() -> None:
            for msg in msgs:
                with contextlib.suppress(Exception):  # disconnected: the redelivery decides
                    await msg.in_progress()
            state["beat"] += 1
            if state["beat"] < beats:
                state["timer"] = loop.call_later(period, due)
            else:
                log.warning("a batch of %d is still being handled after %d ack waits; no longer holding it",
                            len(msgs), PROGRESS_LIMIT)

        def due() -> None:
            state["task"] = loop.create_task(beat())

        state["timer"] = loop.call_later(period, due)
        try:
            yield
        finally:
            state["timer"].cancel()
            if state["task"] is not None:
                state["task"].cancel()
                await asyncio.gather(state["task"], return_exceptions=True)

    # --- consuming -------------------------------------------------------------------------

    async def consume(
        self,
        *,
        stream: str,
        durable: str,
        filter_subjects: list[str],
        decoder: msgspec.json.Decoder,
        handler: Handler,
        batch: int = 64,
        concurrency: int = 1,
        deliver_new: bool = False,
        max_deliver: int | None = None,
        ready: asyncio.Event | None = None,
        batch_handler: BatchHandler | None = None,
    ) -> None:
        """Run a durable pull-consumer loop forever; returns only by cancellation.

        ``concurrency`` > 1 handles the messages of one fetched batch concurrently; handlers must
        then be safe to run side by side (they are idempotent and use compare-and-set anyway).
        ``batch_handler``, when given, receives each fetched batch whole (decoded; invalid payloads
        are already dead-lettered) and returns one outcome per item: None to ack, or the exception
        that decides the message's fate exactly as if a single handler had raised it.
        """
        max_deliver = max_deliver or self.settings.max_deliver
        config = api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.settings.ack_wait,
            max_deliver=max_deliver,
            filter_subjects=filter_subjects,
            deliver_policy=api.DeliverPolicy.NEW if deliver_new else api.DeliverPolicy.ALL,
            max_ack_pending=max(1000, batch * 4),
        )
        sub = await self._bind(stream, config)
        self.consumers[(stream, durable)] = None
        watch = asyncio.create_task(self.watch_exhausted(stream, durable))
        try:
            await self._consume_loop(sub, stream, config, decoder, handler, batch, concurrency, max_deliver,
                                     ready, batch_handler)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def _consume_loop(self, sub, stream, config, decoder, handler, batch, concurrency, max_deliver,
                            ready, batch_handler) -> None:
        durable = config.durable_name
        if ready is not None:
            ready.set()
        limiter = asyncio.Semaphore(concurrency)

        async def one(msg: Msg) -> None:
            async with limiter:
                await self._handle(msg, decoder, handler, max_deliver)

        try:
            while True:
                try:
                    # No idle heartbeat: nats-py 2.16 sends it on its no_wait follow-up pull without
                    # `expires`, which the server rejects ("heartbeat value too large") after it has
                    # already delivered the batch, stranding those messages until ack_wait.
                    msgs = await sub.fetch(batch, timeout=1.0)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue  # no messages: normal
                except NotFoundError:
                    log.warning("consumer %s on %s vanished; recreating", durable, stream)
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                    sub = await self._bind(stream, config)
                    continue
                except (nats.errors.ConnectionClosedError, nats.errors.NoServersError):
                    raise
                except Exception as exc:  # disconnected / reconnecting: wait and try again
                    log.warning("fetch on %s failed (%r %s); retrying", durable, exc, getattr(exc, "description", ""))
                    await asyncio.sleep(0.5)
                    continue
                # The whole fetched batch is signalled, not only the message in hand: the ones still
                # waiting their turn would otherwise outlive ack_wait behind a slow one.
                async with self._progress(msgs):
                    if batch_handler is not None:
                        await self._handle_batch(msgs, decoder, batch_handler, max_deliver)
                    elif concurrency == 1:
                        for msg in msgs:
                            await self._handle(msg, decoder, handler, max_deliver)
                    else:
                        await asyncio.gather(*(one(m) for m in msgs), return_exceptions=True)
        finally:
            # A pull request still open on the server delivers into this inbox after we stop reading
            # it, and a drain waits for a queue nobody empties; unacked, those messages are redelivered.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _bind(self, stream: str, config: api.ConsumerConfig):
        while True:
            try:
                await self.js.add_consumer(stream, config)
                return await self.js.pull_subscribe_bind(config.durable_name, stream=stream)
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
                log.warning("cannot create consumer %s yet (%r); retrying", config.durable_name, exc)
                await asyncio.sleep(0.5)

    async def _handle(
        self, msg: Msg, decoder: msgspec.json.Decoder, handler: Handler, max_deliver: int
    ) -> None:
        headers = dict(msg.headers or {})
        try:
            delivered = msg.metadata.num_delivered
        except Exception:
            delivered = 1
        delivery = Delivery(msg.subject, headers, msg.data, delivered)
        with self.telemetry.span(
            f"{self.service} handle {subjects.event_name(msg.subject)}",
            parent_headers=headers,
            kind=SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "messaging.destination": msg.subject},
        ) as span:
            try:
                try:
                    event = decoder.decode(msg.data)
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    raise PermanentError(f"invalid payload: {exc}") from exc
                if span.is_recording():
                    span.set_attributes(claim_attributes(event))
                for attempt in range(CONFLICT_RETRIES):
                    try:
                        await handler(event, delivery)
                        break
                    except ConflictError:
                        if attempt == CONFLICT_RETRIES - 1:
                            raise TemporaryError("compare-and-set kept losing", delay=0.1)
                        await asyncio.sleep(0.001 * attempt)
                await msg.ack()
                log.debug("acked %s", msg.subject)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                letter = await self._settle_failure(msg, exc, delivered, max_deliver)
                failed(span, exc, dead_letter=letter)

    async def _handle_batch(
        self, msgs: list[Msg], decoder: msgspec.json.Decoder, handler: BatchHandler, max_deliver: int
    ) -> None:
        items: list[tuple[Any, Delivery]] = []
        kept: list[Msg] = []
        for msg in msgs:
            delivery = self._delivery(msg)
            try:
                items.append((decoder.decode(msg.data), delivery))
                kept.append(msg)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                error = PermanentError(f"invalid payload: {exc}")
                letter = await self._give_up(msg, str(error), delivery.num_delivered)
                self._letter_span(delivery, None, error, letter)
        if not items:
            return
        outcomes = await handler(items)
        for msg, (event, delivery), outcome in zip(kept, items, outcomes):
            if outcome is None:
                await msg.ack()
            elif isinstance(outcome, ConflictError):
                await msg.nak(delay=0.01)  # re-read and retry at once, through a redelivery
            else:
                letter = await self._settle_failure(msg, outcome, delivery.num_delivered, max_deliver)
                self._letter_span(delivery, event, outcome, letter)

    def _letter_span(self, delivery: Delivery, event: Any, exc: BaseException, letter: str | None) -> None:
        """A batch handler's spans end before the bus settles its messages, so a message it
        dead-letters gets a span of its own in the message's trace, ERROR and naming the reason."""
        if letter is None or not self.telemetry.exporting:
            return
        if event is None:  # undecodable, or known only from the stream: the subject names the claim
            with contextlib.suppress(ValueError):
                tenant, claim, _, node = subjects.claim_subject_parts(delivery.subject)
                event = Delivered(claim=claim, tenant=tenant, node=node)
        with self.telemetry.span(
            f"{self.service} dead-letter {subjects.event_name(delivery.subject)}",
            parent_headers=delivery.headers,
            kind=SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "messaging.destination": delivery.subject,
                        **claim_attributes(event)},
        ) as span:
            failed(span, exc, dead_letter=letter)

    @staticmethod
    def _delivery(msg: Msg) -> Delivery:
        try:
            delivered = msg.metadata.num_delivered
        except Exception:
            delivered = 1
        return Delivery(msg.subject, dict(msg.headers or {}), msg.data, delivered)

    async def _settle_failure(self, msg: Msg, exc: BaseException, delivered: int, max_deliver: int) -> str | None:
        """Decide a failed message's fate from what its handler raised; the dead-letter reason when
        it was dead-lettered (None: it comes back)."""
        if isinstance(exc, PermanentError):
            return await self._give_up(msg, str(exc), delivered)
        reason = str(exc) if isinstance(exc, TemporaryError) else f"{type(exc).__name__}: {exc}"
        if delivered >= max_deliver:
            return await self._give_up(msg, f"gave up after {delivered} deliveries: {reason}", delivered)
        delay = exc.delay if isinstance(exc, TemporaryError) else min(0.2 * 2**delivered, 10)
        log.warning("retrying %s in %.1fs (%s)", msg.subject, delay, reason)
        try:
            await msg.nak(delay=delay)
        except Exception:  # connection gone: the server redelivers after ack_wait
            pass
        return None

    async def _give_up(self, msg: Msg, reason: str, delivered: int) -> str | None:
        """Dead-letter, then terminate; a message whose letter was not stored is not terminated
        (it comes back, and is dead-lettered then), so nothing is dropped without its letter.
        Returns ``reason`` once the letter is stored, None when it was not."""
        try:
            stream, seq = msg.metadata.stream, msg.metadata.sequence.stream
        except Exception:  # not a JetStream delivery (no metadata): no position to key the letter by
            stream, seq = "", 0
        try:
            await self.dead_letter(msg.subject, msg.data, reason, delivered, stream=stream, seq=seq)
        except Exception as exc:
            log.warning("dead letter for %s not stored (%r); redelivering instead", msg.subject, exc)
            with contextlib.suppress(Exception):  # connection gone: the server redelivers after ack_wait
                await msg.nak(delay=1.0)
            return None
        with contextlib.suppress(Exception):
            await msg.term()
        return reason

    # --- what the metrics read (tessera.shared.metrics) ------------------------------------

    async def consumer_lag(self, timeout: float = 2.0) -> list[tuple[tuple[str, str], tuple[int, int, int]]]:
        """((stream, durable), (pending, ack pending, redelivered)) of each durable consumer this
        process runs; one that cannot be read now is left out."""
        out = []
        for stream, durable in list(self.consumers):
            try:
                info = await self.js.consumer_info(stream, durable, timeout=timeout)
            except (nats.errors.TimeoutError, NotFoundError, nats.errors.ConnectionClosedError) as exc:
                log.debug("no consumer info for %s/%s: %r", stream, durable, exc)
                continue
            out.append(((stream, durable), (info.num_pending or 0, info.num_ack_pending or 0,
                                            info.num_redelivered or 0)))
        return out

    async def dead_letters(self, service: str) -> int:
        """How many dead letters of ``service`` the DLQ stream holds."""
        subject = subjects.dlq(service)
        info = await self.js.stream_info(subjects.STREAM_DLQ, subjects_filter=subject)
        return sum((info.state.subjects or {}).values()) if info.state.messages else 0

    # --- request / reply -------------------------------------------------------------------

    async def serve(self, subject: str, handler: ApiHandler, *, queue: str | None = None,
                    with_subject: bool = False) -> None:
        """Answer requests on ``subject`` forever; each request runs in its own task and span.

        ``with_subject``: the handler is called ``(subject, data, headers)`` with the subject the
        request arrived on (a wildcard ``subject`` whose tokens the server set, e.g. a tenant's)."""
        inflight: set[asyncio.Task] = set()

        async def answer(msg: Msg) -> None:
            headers = dict(msg.headers or {})
            with self.telemetry.span(
                f"{self.service} serve {subject}", parent_headers=headers, kind=SpanKind.SERVER
            ):
                try:
                    if with_subject:
                        reply = await handler(msg.subject, msg.data, headers)
                    else:
                        reply = await handler(msg.data, headers)
                except (TemporaryError, ConflictError, nats.errors.Error, asyncio.TimeoutError) as exc:
                    # The bus went away under the handler (a NATS leader changing): say so at once,
                    # so the caller retries (every API is safe to retry) instead of waiting out its
                    # timeout for an answer that never comes.
                    log.warning("%s: cannot answer a request on %s now (%r)", self.service, msg.subject, exc)
                    reply = api_replies.error(f"{self.service} cannot answer now ({exc!r}); try again", code="unavailable")
                if msg.reply:
                    with contextlib.suppress(nats.errors.Error):
                        await msg.respond(reply)

        async def on_msg(msg: Msg) -> None:
            task = asyncio.create_task(answer(msg))
            inflight.add(task)
            task.add_done_callback(inflight.discard)

        sub = await self.nc.subscribe(subject, queue=queue or f"tessera-{self.service}", cb=on_msg)
        try:
            await asyncio.Event().wait()
        finally:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
            for task in list(inflight):
                task.cancel()

    async def request(self, subject: str, payload: bytes, timeout: float = 5.0) -> bytes:
        try:
            msg = await self.nc.request(subject, payload, timeout=timeout, headers=inject({}))
        except nats.errors.NoRespondersError:
            raise TemporaryError(f"no service answers on {subject}: is it running?") from None
        except nats.errors.TimeoutError:
            raise TemporaryError(f"no answer on {subject} within {timeout}s") from None
        return msg.data


