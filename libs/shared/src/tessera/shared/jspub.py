"""Pipelined JetStream publishing: many publishes in flight, one reply subscription per connection.

The hot paths (placement's ledger, claim-record and ``allocated`` writes; the enforcer's and capacity
publisher's event batches) publish hundreds of messages and then wait for all of their acks. nats-py's
``publish_async`` spends its CPU per message on a future per call behind a semaphore and a JSON ack
turned into a dataclass, and ``KeyValue.update`` more (a request with its own timer). Here every
publish carries a reply subject under one wildcard inbox, acks are matched to a counter token and
decoded with msgspec: about half the CPU of a publish (measured in bench/placement_sim.md). The wire protocol is JetStream's own: a
publish with a reply subject, answered by the stream with a PubAck or an API error (and by the server
with a 503 status when no stream listens on the subject).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Sequence

import msgspec
from nats.aio.client import Client
from nats.aio.subscription import Subscription

WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code for a failed Nats-Expected-Last-*-Sequence check
# A publish not taken *yet*: the same Nats-Msg-Id is still being stored (a retry racing its first
# attempt while a stream leader moves), or the stream is unavailable for now (503). Retry later.
DUPLICATE_IN_PROCESS = 10158


def not_now(code: int, err_code: int) -> bool:
    """Whether a JetStream refusal means "not yet" rather than "no"."""
    return err_code == DUPLICATE_IN_PROCESS or code == 503


class ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: ApiError | None = None


_ack = msgspec.json.Decoder(PubAck)


class PublishError(Exception):
    """JetStream refused a publish (``err_code`` says why) or no stream listens on its subject."""

    def __init__(self, subject: str, description: str, code: int = 0, err_code: int = 0) -> None:
        super().__init__(f"publish to {subject}: {description}")
        self.subject = subject
        self.code = code
        self.err_code = err_code

    @property
    def wrong_last_sequence(self) -> bool:
        return self.err_code == WRONG_LAST_SEQUENCE

    @property
    def not_now(self) -> bool:
        return not_now(self.code, self.err_code)


class Publisher:
    """Pipelined publishes over one connection. Use `publisher(nc)` to share one per connection."""

    def __init__(self, nc: Client, timeout: float = 10.0) -> None:
        self.nc = nc
        self.timeout = timeout
        self._prefix = ""
        self._sub: Subscription | None = None
        self._next = 0
        self._waiting: dict[str, tuple[asyncio.Future, str]] = {}
        self._starting = asyncio.Lock()

    async def _start(self) -> None:
        async with self._starting:
            if self._sub is None:
                prefix = self.nc.new_inbox() + "."
                self._sub = await self.nc.subscribe(prefix + "*", cb=self._on_reply)
                self._prefix = prefix

    async def _on_reply(self, msg) -> None:
        waiting = self._waiting.pop(msg.subject[len(self._prefix):], None)
        if waiting is None:
            return  # the publish already timed out
        future, subject = waiting
        if future.done():
            return
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            future.set_result(PublishError(subject, "no stream listens on this subject (no responders)", 503))
            return
        try:
            ack = _ack.decode(msg.data)
        except msgspec.DecodeError:
            future.set_result(PublishError(subject, f"unreadable reply {msg.data[:80]!r}"))
            return
        if ack.error is not None:
            future.set_result(PublishError(subject, ack.error.description, ack.error.code, ack.error.err_code))
        else:
            future.set_result(ack)

    async def publish(self, items: Sequence[tuple[str, bytes, dict[str, str] | None]]) -> list[PubAck | Exception]:
        """Publish every ``(subject, payload, headers)`` without waiting in between, then wait for all
        acks. Per item: its PubAck, or the exception saying why it was not stored (`PublishError`,
        `TimeoutError` when no reply came within the timeout, or the connection's own error)."""
        if self._sub is None:
            await self._start()
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future] = []
        tokens: list[str] = []
        waiting = self._waiting
        prefix = self._prefix
        publish = self.nc.publish
        for subject, payload, headers in items:
            self._next += 1
            token = str(self._next)
            future = loop.create_future()
            waiting[token] = (future, subject)
            futures.append(future)
            tokens.append(token)
            try:
                await publish(subject, payload, reply=prefix + token, headers=headers)
            except Exception as exc:  # connection closed, bad subject...: this item fails, not the batch
                waiting.pop(token, None)
                future.set_result(exc)
        if futures:
            _, late = await asyncio.wait(futures, timeout=self.timeout)
            for future in late:
                future.set_result(TimeoutError(f"no acknowledgement from JetStream in {self.timeout:.0f}s"))
            for token in tokens:
                waiting.pop(token, None)
        return [f.result() for f in futures]


_publishers: "weakref.WeakKeyDictionary[Client, Publisher]" = weakref.WeakKeyDictionary()


def publisher(nc: Client) -> Publisher:
    """The connection's shared `Publisher` (created on first use)."""
    p = _publishers.get(nc)
    if p is None:
        p = _publishers[nc] = Publisher(nc)
    return p


async def kv_update_many(kv, items: Sequence[tuple[str, bytes, int]]) -> list[int | None | Exception]:
    """Compare-and-set writes of many ``(key, value, revision)`` to a KV bucket, pipelined (revision 0:
    the key must not exist yet). Per item: the new revision, None where the key is no longer at the
    revision given, or the error that stopped the write. (A KV write is a publish on
    ``$KV.<bucket>.<key>`` with the expected last sequence; nats-py's KeyValue keeps its context and
    subject prefix private, and is pinned in libs/shared.)"""
    acks = await publisher(kv._js._nc).publish([
        (kv._pre + key, value, {"Nats-Expected-Last-Subject-Sequence": str(revision)})
        for key, value, revision in items
    ])
    return [None if isinstance(ack, PublishError) and ack.wrong_last_sequence
            else ack if isinstance(ack, Exception) else ack.seq for ack in acks]
