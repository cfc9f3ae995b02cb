"""The live keys (and values) of a JetStream KV bucket, read without nats-py's "empty bucket" race.

nats-py's ``KeyValue.keys()`` pushes the bucket to an ordered consumer and calls the bucket empty when
the consumer's info says nothing is pending and the client has *received* nothing yet. The server
writes the pushed messages and the info reply from different places, so on a loaded machine the reply
can overtake every message: ``keys()`` then reports an empty bucket that is not empty (CI saw a live
ledger read as ``{}``; a reconciler acting on such a list would drop every tenant).

Here the consumer is a *pull* consumer, so nothing is delivered before we ask: the pending count in its
info is the exact number of keys to read, and "empty" is only ever the server's own answer. Deleted and
purged keys are left out, as ``keys()`` does. ``live_entries`` reads the values the same way, in
batches of 512 per round trip, where a ``get`` per key would cost one round trip each.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Callable

import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.kv import KeyValue

from tessera.shared.errors import TemporaryError

_DELETED = {"DEL", "PURGE"}
_FETCH = 512


async def live_keys(kv: KeyValue, timeout: float = 10.0) -> list[str]:
    """Every key of ``kv`` whose latest entry is a value (not a delete or purge marker), sorted."""
    return sorted(await _scan(kv, timeout, headers_only=True))


async def live_entries(kv: KeyValue, timeout: float = 10.0) -> dict[str, tuple[bytes, int]]:
    """Every live key of ``kv`` with its latest value and that value's revision."""
    return await _scan(kv, timeout, headers_only=False)


async def live_values(kv: KeyValue, decoder, on_error: Callable[[str, Exception], None] | None = None,
                      timeout: float = 10.0) -> dict[str, Any]:
    """Every live, non-empty value of ``kv`` decoded with ``decoder``, by key (in key order). A value
    that does not decode raises, or with ``on_error`` is reported to it and left out."""
    out: dict[str, Any] = {}
    entries = await live_entries(kv, timeout)
    for key in sorted(entries):
        data = entries[key][0]
        if not data:
            continue
        try:
            out[key] = decoder.decode(data)
        except Exception as exc:
            if on_error is None:
                raise
            on_error(key, exc)
    return out


async def _scan(kv: KeyValue, timeout: float, headers_only: bool) -> dict[str, tuple[bytes, int]]:
    """A server that does not answer (a cluster electing the bucket's new leader, a reconnect) is a
    TemporaryError: the caller retries later, as for any other I/O, instead of dying on a bare timeout."""
    try:
        return await _scan_once(kv, timeout, headers_only)
    except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError,
            nats.errors.ConnectionReconnectingError, nats.js.errors.ServiceUnavailableError) as exc:
        raise TemporaryError(f"cannot read the KV bucket {kv._stream[3:]} now: {exc!r}") from exc


async def _scan_once(kv: KeyValue, timeout: float, headers_only: bool) -> dict[str, tuple[bytes, int]]:
    # KeyValue keeps its context, stream and subject prefix private; nats-py is pinned in libs/shared.
    js, stream, prefix = kv._js, kv._stream, kv._pre
    sub = await js.pull_subscribe(
        f"{prefix}>",
        stream=stream,
        config=api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=api.AckPolicy.NONE,
            headers_only=headers_only,
            mem_storage=True,
            inactive_threshold=60.0,
        ),
    )
    info = None
    try:
        info = await sub.consumer_info()
        pending = info.num_pending
        entries: dict[str, tuple[bytes, int]] = {}
        while pending:
            for msg in await sub.fetch(min(pending, _FETCH), timeout=timeout):
                operation = (msg.headers or {}).get("KV-Operation")
                reason = (msg.headers or {}).get("Nats-Marker-Reason")
                key = msg.subject[len(prefix):]
                if operation in _DELETED or reason:
                    entries.pop(key, None)
                else:
                    entries[key] = (msg.data, msg.metadata.sequence.stream)
                pending = msg.metadata.num_pending
        return entries
    finally:
        await sub.unsubscribe()
        if info is not None:
            # The server would drop it after inactive_threshold anyway; a failed delete only waits for that.
            with contextlib.suppress(nats.errors.Error):
                await js.delete_consumer(stream, info.name)
