"""The one module that talks to NATS: connection, topology, publish, consume, KV, request/reply.

Delivery is at least once, so correctness comes from the rules this module applies everywhere:
every publish carries a ``Nats-Msg-Id`` (deduplicated by the stream) and a W3C ``traceparent``;
consumers are durable pull consumers with an explicit ``max_deliver``; what a handler raises decides
the fate of the message (see tessera.shared.errors): terminate + dead-letter, redeliver later, or
retry now. Streams and buckets are created in one place, with production settings.

What a service consumes it declares as a `tessera.shared.subscriptions.Subscription` (or
``BatchSubscription``) and what it publishes in bulk as `Outgoing` items. The connection and its
JetStream context are private: what the CLI, tools and tests need of them has a named method.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Literal, Mapping, TypeVar, cast, overload
from urllib.parse import urlsplit

import msgspec
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry.trace import Span, SpanKind

from tessera.shared import api as api_replies
from tessera.shared import identities, subjects, topology
from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.events import DeadLetter, encode
from tessera.shared.jspub import PubAck, PublishError, not_now, publisher
from tessera.shared.settings import BusSettings
from tessera.shared.subscriptions import (
    ACK,
    CONFLICT_RETRIES,
    BatchHandler,
    BatchSubscription,
    Delivery,
    Handler,
    Subscription,
    kept_losing,
    verdict,
)
from tessera.shared.telemetry import Telemetry, claim_attributes, failed, inject

log = logging.getLogger("tessera.bus")

# How long a closing bus lets in-flight acks and publishes finish before it closes the connection.
DRAIN_SECONDS = 5.0

__all__ = [
    "BatchHandler",
    "BatchSubscription",
    "Bus",
    "Delivery",
    "Handler",
    "KeyNotFoundError",
    "KeyWrongLastSequenceError",
    "KeyValue",
    "Outgoing",
    "Subscription",
]

E = TypeVar("E")

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


class Outgoing(msgspec.Struct, frozen=True):
    """One message for `Bus.publish_many`: ``event`` on ``subject``, deduplicated by the stream on
    ``msg_id``. ``headers``, when given, replace the current span's trace context: a
    ``traceparent`` captured earlier, when the publish happens outside the span that decided it."""

    subject: str
    event: msgspec.Struct
    msg_id: str | None = None
    headers: Mapping[str, str] | None = None


ApiHandler = Callable[[bytes, Mapping[str, str]], Awaitable[bytes]]
# A handler that is also told the subject the request arrived on (`Bus.serve`'s ``with_subject``).
SubjectApiHandler = Callable[[str, bytes, Mapping[str, str]], Awaitable[bytes]]


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
    tenant created or deleted) re-registers each account's JetStream API, and for a moment requests
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
        self._nc = nc
        self._js = nc.jetstream()
        self.settings = settings
        self.service = service
        self.telemetry = telemetry
        self._kv: dict[str, KeyValue] = {}
        self.consumers: dict[tuple[str, str], None] = {}  # (stream, durable) this process consumes
        self.declared = topology.declare(settings.topology())  # the streams and buckets, with their limits
        self._state = {"closing": False}  # shared with `connect`'s callbacks: a disconnect while closing is quiet

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
        self._state["closing"] = True
        if self._nc.is_closed:
            return
        try:  # past DRAIN_SECONDS nats-py reports DrainTimeoutError (logged by on_error) and closes
            await asyncio.wait_for(self._nc.drain(), timeout=DRAIN_SECONDS + 5)
        except Exception:  # already disconnected, or the drain itself stuck: close regardless
            await self._nc.close()

    # --- topology --------------------------------------------------------------------------

    async def ensure_topology(self) -> dict[str, str]:
        """Make the server hold the streams and KV buckets this service uses (its identity may touch
        no others: `tessera.shared.identities`) as `tessera.shared.topology` declares them: created
        when missing, replicas and limits updated when they differ; every one for a tool with no
        entry there. Only services (and tests acting as them) call this; readers only bind."""
        streams, buckets = identities.topology(self.service)
        return await topology.ensure(self._js, self.declared, streams, buckets)

    async def kv(self, bucket: str) -> KeyValue:
        """Bind to an existing bucket; `topology.TopologyMissing` (start the services first) when absent."""
        kv = self._kv.get(bucket)
        if kv is None:
            kv = self._kv[bucket] = await topology.bind(self._js, bucket)
        return kv

    # --- publishing ------------------------------------------------------------------------

    def _headers(self, msg_id: str | None) -> dict[str, str]:
        headers = inject({})
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        return headers

    async def publish(self, subject: str, event: msgspec.Struct, *, msg_id: str | None = None) -> api.PubAck:
        try:
            return await self._js.publish(subject, encode(event), headers=self._headers(msg_id), timeout=5)
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError, nats.js.errors.NoStreamResponseError) as exc:
            raise TemporaryError(f"publish to {subject} failed: {exc!r}") from exc
        except nats.js.errors.APIError as exc:
            if not_now(exc.code or 0, exc.err_code or 0):
                raise TemporaryError(f"publish to {subject} not taken yet ({exc.description}); retry later") from exc
            raise

    async def publish_many(self, items: Iterable[Outgoing]) -> list[PubAck]:
        """Publish without waiting for each ack in turn, then gather the acks (much faster).
        Raises the first failure after every item has been tried."""
        batch = []
        try:
            for item in items:
                if item.headers is None:
                    headers = self._headers(item.msg_id)
                else:
                    headers = dict(item.headers)
                    if item.msg_id:
                        headers["Nats-Msg-Id"] = item.msg_id
                batch.append((item.subject, encode(item.event), headers))
        except AttributeError as exc:
            raise TypeError(f"publish_many takes Outgoing items, got {type(item).__name__} ({exc}): "
                            f"write Outgoing(subject, event, msg_id)") from None
        acks = await publisher(self._nc).publish(batch)
        for ack in acks:
            if isinstance(ack, PublishError) and ack.not_now:
                raise TemporaryError(f"{ack}: not taken yet; retry later") from ack
            if isinstance(ack, Exception):
                raise ack
        return acks  # type: ignore[return-value]  # none is an exception here

    async def stored(self, stream: str, subject: str) -> bool:
        """Whether ``stream`` holds a message on exactly ``subject`` (a reconciler asking whether an
        event it owes was ever published)."""
        try:
            await self._js.get_last_msg(stream, subject)
            return True
        except NotFoundError:
            return False
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError) as exc:
            raise TemporaryError(f"cannot read {stream} for {subject}: {exc!r}") from exc

    async def follow(self, subject: str, decoder: msgspec.json.Decoder,
                     on_event: Callable[[Any, Mapping[str, str]], Awaitable[None] | None], *,
                     subscribed: Callable[[], Awaitable[None]] | None = None) -> None:
        """Watch ``subject`` on core NATS (no storage, no acks) and hand each event and its headers
        to ``on_event``; runs until cancelled. For signs of life and hints that every replica
        follows: what does not decode is skipped here (the streams' consumers dead-letter it).

        ``subscribed`` is awaited once the server holds the subscription and before the first event
        is handed on (what arrives meanwhile waits): a read of what is already there (a bucket's
        keys) done in it can then miss nothing that the subscription does not deliver. Read before
        subscribing, something published between the read and the subscription is seen by neither."""
        sub = await self._nc.subscribe(subject)
        try:
            if subscribed is not None:
                await self._nc.flush()  # the server has the subscription: what it is sent from now is ours
                await subscribed()
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
                    stored = await self._js.get_msg(stream, advisory.stream_seq)
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

        sub = await self._nc.subscribe(MAX_DELIVERIES_ADVISORY.format(stream=stream, consumer=durable),
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

    async def consume(self, subscription: Subscription[E]) -> None:
        """Run ``subscription``'s durable pull consumer forever, one handler call per message;
        returns only by cancellation."""
        if not isinstance(subscription, Subscription):
            raise TypeError(f"consume takes a Subscription, got {type(subscription).__name__}"
                            + (": a BatchSubscription goes to consume_batches"
                               if isinstance(subscription, BatchSubscription) else ""))
        max_deliver = subscription.max_deliver or self.settings.max_deliver
        concurrency = subscription.concurrency
        limiter = asyncio.Semaphore(concurrency)

        async def one(msg: Msg) -> None:
            async with limiter:
                await self._handle(msg, subscription, max_deliver)

        async def handle(msgs: list[Msg]) -> None:
            if concurrency == 1:
                for msg in msgs:
                    await self._handle(msg, subscription, max_deliver)
            else:
                await asyncio.gather(*(one(m) for m in msgs), return_exceptions=True)

        await self._consume(subscription, max_deliver, handle)

    async def consume_batches(self, subscription: BatchSubscription[E]) -> None:
        """Run ``subscription``'s durable pull consumer forever, one handler call per fetched batch;
        returns only by cancellation. Each item's outcome settles its message exactly as if a
        handler of one message had raised it (`tessera.shared.subscriptions.verdict`)."""
        if not isinstance(subscription, BatchSubscription):
            raise TypeError(f"consume_batches takes a BatchSubscription, got {type(subscription).__name__}"
                            + (": a Subscription goes to consume" if isinstance(subscription, Subscription) else ""))
        max_deliver = subscription.max_deliver or self.settings.max_deliver

        async def handle(msgs: list[Msg]) -> None:
            await self._handle_batch(msgs, subscription, max_deliver)

        await self._consume(subscription, max_deliver, handle)

    async def _consume(self, subscription: Subscription[Any] | BatchSubscription[Any], max_deliver: int,
                       handle: Callable[[list[Msg]], Awaitable[None]]) -> None:
        stream = subscription.stream
        config = api.ConsumerConfig(
            durable_name=subscription.durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.settings.ack_wait,
            max_deliver=max_deliver,
            filter_subjects=list(subscription.filter_subjects),
            deliver_policy=api.DeliverPolicy.NEW if subscription.deliver_new else api.DeliverPolicy.ALL,
            max_ack_pending=max(1000, subscription.batch * 4),
        )
        sub = await self._bind(stream, config)
        self.consumers[(stream, subscription.durable)] = None
        watch = asyncio.create_task(self.watch_exhausted(stream, subscription.durable))
        try:
            await self._consume_loop(sub, stream, config, subscription.batch, handle)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def _consume_loop(self, sub, stream: str, config: api.ConsumerConfig, batch: int,
                            handle: Callable[[list[Msg]], Awaitable[None]]) -> None:
        durable = config.durable_name
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
                    await handle(msgs)
        finally:
            # A pull request still open on the server delivers into this inbox after we stop reading
            # it, and a drain waits for a queue nobody empties; unacked, those messages are redelivered.
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _bind(self, stream: str, config: api.ConsumerConfig):
        while True:
            try:
                await self._js.add_consumer(stream, config)
                return await self._js.pull_subscribe_bind(config.durable_name, stream=stream)
            except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError) as exc:
                log.warning("cannot create consumer %s yet (%r); retrying", config.durable_name, exc)
                await asyncio.sleep(0.5)

    async def _handle(self, msg: Msg, subscription: Subscription[Any], max_deliver: int) -> None:
        """One message in a span of its own: decode, run the handler (a lost compare-and-set runs it
        again at once), settle."""
        delivery = self._delivery(msg)
        with self.telemetry.span(
            f"{self.service} handle {subjects.event_name(msg.subject)}",
            parent_headers=delivery.headers,
            kind=SpanKind.CONSUMER,
            attributes={"messaging.system": "nats", "messaging.destination": msg.subject},
        ) as span:
            event = None
            outcome: BaseException | None = None
            try:
                event = self._decode(subscription.decoder, delivery)
                if span.is_recording():
                    span.set_attributes(claim_attributes(event))
                for attempt in range(CONFLICT_RETRIES):
                    try:
                        await subscription.handler(event, delivery)
                        break
                    except ConflictError as exc:
                        if attempt == CONFLICT_RETRIES - 1:
                            raise kept_losing() from exc
                        await asyncio.sleep(0.001 * attempt)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                outcome = exc
            await self._settle(msg, delivery, event, outcome, max_deliver, span)

    async def _handle_batch(self, msgs: list[Msg], subscription: BatchSubscription[Any], max_deliver: int) -> None:
        """One fetched batch: decode each (what does not decode is settled at once), hand the
        rest to the batch handler, settle each by its outcome."""
        items: list[tuple[Any, Delivery]] = []
        kept: list[Msg] = []
        for msg in msgs:
            delivery = self._delivery(msg)
            try:
                items.append((self._decode(subscription.decoder, delivery), delivery))
                kept.append(msg)
            except PermanentError as error:
                await self._settle(msg, delivery, None, error, max_deliver, None)
        if not items:
            return
        outcomes = list(await subscription.handler(items))
        if len(outcomes) != len(items):
            log.error("the batch handler of %s returned %d outcomes for %d messages; the rest are redelivered",
                      subscription.durable, len(outcomes), len(items))
            missing = TemporaryError(f"the batch handler of {subscription.durable} returned no outcome for it")
            outcomes = (outcomes + [missing] * len(items))[: len(items)]
        for msg, (event, delivery), outcome in zip(kept, items, outcomes):
            await self._settle(msg, delivery, event, outcome, max_deliver, None)

    @staticmethod
    def _decode(decoder: msgspec.json.Decoder, delivery: Delivery) -> Any:
        try:
            return decoder.decode(delivery.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise PermanentError(f"invalid payload: {exc}") from exc

    async def _settle(self, msg: Msg, delivery: Delivery, event: Any, outcome: BaseException | None,
                      max_deliver: int, span: Span | None) -> None:
        """Ack, redeliver or dead-letter ``msg`` as `verdict` says for ``outcome``, and put a
        failure on the message's trace: on ``span`` when the bus handled the message in one, else
        (a batch handler's spans have ended) on a span of its own when it was dead-lettered."""
        decided = verdict(outcome, delivery.num_delivered, max_deliver)
        if decided is ACK:
            try:
                await msg.ack()
            except Exception as exc:  # connection gone: the server redelivers after ack_wait
                log.warning("ack of %s not sent (%r); it is redelivered after ack_wait", msg.subject, exc)
                if span is not None:
                    failed(span, exc)
            else:
                log.debug("acked %s", msg.subject)
            return
        assert outcome is not None
        letter = None
        if decided.action == "dead-letter":
            letter = await self._give_up(msg, decided.reason, delivery.num_delivered)
        else:
            (log.debug if decided.routine else log.warning)(
                "retrying %s in %.2fs (%s)", msg.subject, decided.delay, decided.reason)
            with contextlib.suppress(Exception):  # connection gone: the server redelivers after ack_wait
                await msg.nak(delay=decided.delay)
        if span is not None:
            failed(span, outcome, dead_letter=letter)
        else:
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

    # --- the connection and the server's state, by name (the CLI, tools, tests) -------------
    # The connection and its JetStream context stay private; what callers outside the bus need of
    # them is named here. These raise nats' own errors unchanged (callers tell them apart).

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    @property
    def connected_url(self):
        """The server this connection is on now (a parsed URL), None while disconnected."""
        return self._nc.connected_url

    async def flush(self, timeout: int = 10) -> None:
        """Wait until the server has everything published so far on core NATS."""
        await self._nc.flush(timeout=timeout)

    async def send(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        """Core-NATS publish of raw bytes: no stream acknowledgement, no message id, no trace."""
        await self._nc.publish(subject, data, headers=headers)

    async def listen(self, subject: str, cb: Callable[[Msg], Awaitable[None]]):
        """Subscribe ``cb`` to ``subject`` on core NATS; returns the subscription (call its
        ``unsubscribe``). `follow` is the decoding, self-cleaning form."""
        return await self._nc.subscribe(subject, cb=cb)

    async def publish_bytes(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None,
                            timeout: float = 5.0) -> api.PubAck:
        """A stream publish of raw bytes (a replayed letter, a test's malformed event), headers as
        given: no trace context or message id is added."""
        return await self._js.publish(subject, data, headers=headers, timeout=timeout)

    async def publish_async(self, subject: str, data: bytes, *, headers: dict[str, str] | None = None):
        """A stream publish of raw bytes whose ack is not awaited here (a benchmark's fixed-rate
        load); returns the ack's future."""
        return await self._js.publish_async(subject, data, headers=headers)

    async def stream_info(self, stream: str, *, subjects_filter: str | None = None,
                          timeout: float | None = None) -> api.StreamInfo:
        if timeout is None:
            return await self._js.stream_info(stream, subjects_filter=subjects_filter)
        return await self._nc.jetstream(timeout=timeout).stream_info(stream, subjects_filter=subjects_filter)

    async def streams_info(self) -> list[api.StreamInfo]:
        return await self._js.streams_info()

    async def consumer_info(self, stream: str, durable: str) -> api.ConsumerInfo:
        return await self._js.consumer_info(stream, durable)

    async def consumers_info(self, stream: str) -> list[api.ConsumerInfo]:
        return await self._js.consumers_info(stream)

    async def stored_message(self, stream: str, seq: int) -> api.RawStreamMsg:
        """The message at ``seq`` of ``stream`` (`NotFoundError` when there is none)."""
        return await self._js.get_msg(stream, seq)

    async def last_message(self, stream: str, subject: str) -> api.RawStreamMsg:
        """The last message ``stream`` holds on ``subject`` (`NotFoundError` when there is none)."""
        return await self._js.get_last_msg(stream, subject)

    async def pull_subscribe(self, subject: str, *, stream: str, config: api.ConsumerConfig):
        """An ephemeral pull consumer on ``stream`` (a CLI reading a stream through once)."""
        return await self._js.pull_subscribe(subject, stream=stream, config=config)

    async def pull_subscribe_bind(self, durable: str, *, stream: str):
        """Bind to an existing durable pull consumer (a test acting as a second consumer process)."""
        return await self._js.pull_subscribe_bind(durable, stream=stream)

    async def subscribe_ordered(self, subject: str, *, stream: str, cb: Callable[[Msg], Awaitable[None]],
                                config: api.ConsumerConfig):
        """An ordered push consumer on ``stream`` delivering to ``cb`` (a viewer following a stream)."""
        return await self._js.subscribe(subject, stream=stream, cb=cb, ordered_consumer=True, config=config)

    async def delete_bucket(self, bucket: str) -> None:
        """Delete a KV bucket (`BucketNotFoundError` / `NotFoundError` when it does not exist)."""
        await self._js.delete_key_value(bucket)
        self._kv.pop(bucket, None)

    # --- what the metrics read (tessera.shared.metrics) ------------------------------------

    async def consumer_lag(self, timeout: float = 2.0) -> list[tuple[tuple[str, str], tuple[int, int, int]]]:
        """((stream, durable), (pending, ack pending, redelivered)) of each durable consumer this
        process runs; one that cannot be read now is left out."""
        out = []
        for stream, durable in list(self.consumers):
            try:
                info = await self._js.consumer_info(stream, durable, timeout=timeout)
            except (nats.errors.TimeoutError, NotFoundError, nats.errors.ConnectionClosedError) as exc:
                log.debug("no consumer info for %s/%s: %r", stream, durable, exc)
                continue
            out.append(((stream, durable), (info.num_pending or 0, info.num_ack_pending or 0,
                                            info.num_redelivered or 0)))
        return out

    async def dead_letters(self, service: str) -> int:
        """How many dead letters of ``service`` the DLQ stream holds."""
        subject = subjects.dlq(service)
        info = await self._js.stream_info(subjects.STREAM_DLQ, subjects_filter=subject)
        return sum((info.state.subjects or {}).values()) if info.state.messages else 0

    # --- request / reply -------------------------------------------------------------------

    @overload
    async def serve(self, subject: str, handler: ApiHandler, *, queue: str | None = None,
                    with_subject: Literal[False] = False) -> None: ...

    @overload
    async def serve(self, subject: str, handler: SubjectApiHandler, *, queue: str | None = None,
                    with_subject: Literal[True]) -> None: ...

    async def serve(self, subject: str, handler: ApiHandler | SubjectApiHandler, *, queue: str | None = None,
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
                    # (the overloads pair ``with_subject`` with the handler's signature)
                    if with_subject:
                        reply = await cast(SubjectApiHandler, handler)(msg.subject, msg.data, headers)
                    else:
                        reply = await cast(ApiHandler, handler)(msg.data, headers)
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

        sub = await self._nc.subscribe(subject, queue=queue or f"tessera-{self.service}", cb=on_msg)
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
            msg = await self._nc.request(subject, payload, timeout=timeout, headers=inject({}))
        except nats.errors.NoRespondersError:
            raise TemporaryError(f"no service answers on {subject}: is it running?") from None
        except nats.errors.TimeoutError:
            raise TemporaryError(f"no answer on {subject} within {timeout}s") from None
        return msg.data


