"""The live keys of a JetStream KV bucket, read without nats-py's "empty bucket" race.

nats-py's ``KeyValue.keys()`` pushes the bucket to an ordered consumer and calls the bucket empty when
the consumer's info says nothing is pending and the client has *received* nothing yet. The server
writes the pushed messages and the info reply from different places, so on a loaded machine the reply
can overtake every message: ``keys()`` then reports an empty bucket that is not empty (CI saw a live
ledger read as ``{}``; a reconciler acting on such a list would drop every tenant).

Here the consumer is a *pull* consumer, so nothing is delivered before we ask: the pending count in its
info is the exact number of keys to read, and "empty" is only ever the server's own answer. Deleted and
purged keys are left out, as ``keys()`` does.
"""

from __future__ import annotations

import contextlib

import nats.errors
from nats.js import api
from nats.js.kv import KeyValue

_DELETED = {"DEL", "PURGE"}
_FETCH = 512


async def live_keys(kv: KeyValue, timeout: float = 10.0) -> list[str]:
    """Every key of ``kv`` whose latest entry is a value (not a delete or purge marker), sorted."""
    # KeyValue keeps its context, stream and subject prefix private; nats-py is pinned in libs/shared.
    js, stream, prefix = kv._js, kv._stream, kv._pre
    sub = await js.pull_subscribe(
        f"{prefix}>",
        stream=stream,
        config=api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=api.AckPolicy.NONE,
            headers_only=True,
            mem_storage=True,
            inactive_threshold=60.0,
        ),
    )
    info = None
    try:
        info = await sub.consumer_info()
        pending = info.num_pending
        keys: set[str] = set()
        while pending:
            for msg in await sub.fetch(min(pending, _FETCH), timeout=timeout):
                operation = (msg.headers or {}).get("KV-Operation")
                reason = (msg.headers or {}).get("Nats-Marker-Reason")
                if operation in _DELETED or reason:
                    keys.discard(msg.subject[len(prefix):])
                else:
                    keys.add(msg.subject[len(prefix):])
                pending = msg.metadata.num_pending
        return sorted(keys)
    finally:
        await sub.unsubscribe()
        if info is not None:
            # The server would drop it after inactive_threshold anyway; a failed delete only waits for that.
            with contextlib.suppress(nats.errors.Error):
                await js.delete_consumer(stream, info.name)
