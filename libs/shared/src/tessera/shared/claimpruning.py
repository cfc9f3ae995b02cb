"""Removing released claims from the claims bucket once their retention period is over.

The bucket kept every claim that ever existed, and services read it whole at start-up, so start-up
and `tessera status` grew with the platform's age. The record pruner named by
`tessera.shared.lifecycle` (``RECORD_PRUNER``, the translator, which creates every record) runs
`prune_loop`: every ``claim_prune_interval`` it removes the records that ended (``lifecycle.ENDED``:
released) whose last change is older than the retention.

How a record is removed matters more than when: with a stream purge of the record's KV subject
*up to and including the revision that was read* (``seq = revision + 1``). Whatever was written to
the key after that read (a claim id reused by a new submit) has a higher sequence and is kept: the
purge is fenced by revision, so a live claim is never removed, and several replicas pruning at once
remove each record once. Nothing is left behind (no delete marker), so the bucket shrinks.

The retention is never shorter than the claims stream's own max age: by the time a record goes, no
event about its claim is left in the stream to be redelivered and resurrect it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import nats.errors
import nats.js.errors
import msgspec

from tessera.shared import lifecycle, subjects
from tessera.shared.errors import TemporaryError
from tessera.shared.kvkeys import live_entries

log = logging.getLogger("tessera.claimpruning")


class _Ended(msgspec.Struct):
    """The fields of a claim record the pruner reads (an old or newer record decodes as well)."""

    state: str = ""
    updated: float = 0.0


_decode = msgspec.json.Decoder(_Ended).decode


@dataclass
class Pruned:
    removed: int = 0
    kept: int = 0  # ended, but changed between the read and the purge (or not old enough)
    live: int = 0


def effective_retention(retention: float, stream_max_age: float) -> float:
    """The retention actually applied: never shorter than the claims stream keeps its events."""
    return max(retention, stream_max_age)


async def prune_once(kv, retention: float, *, now: float | None = None) -> Pruned:
    """One pass over the bucket; ``retention`` in seconds (see `effective_retention`)."""
    now = time.time() if now is None else now
    js, stream, prefix = kv._js, kv._stream, kv._pre
    out = Pruned()
    for key, (data, revision) in (await live_entries(kv)).items():
        try:
            record = _decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            out.live += 1  # not ours to judge: the readers report it
            continue
        if record.state not in lifecycle.ENDED:
            out.live += 1
            continue
        if record.updated + retention > now:
            out.kept += 1
            continue
        # Everything of this key up to and including `revision`; a later write survives.
        await js.purge_stream(stream, subject=f"{prefix}{key}", seq=revision + 1)
        if await _still_there(kv, key, revision):
            out.kept += 1
        else:
            out.removed += 1
    return out


async def _still_there(kv, key: str, revision: int) -> bool:
    """Whether ``key`` holds a value written after ``revision`` (the purge kept it)."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return False
    return entry.revision > revision


async def prune_loop(bus, retention: float, interval: float) -> None:
    """Root task of the record pruner: prune every ``interval`` seconds; retention 0 disables it."""
    if retention <= 0:
        log.info("claim records are kept forever (TESSERA_CLAIM_RETENTION=0)")
        await asyncio.Event().wait()
    stream_age = bus.declared.streams[subjects.STREAM_CLAIMS].max_age
    applied = effective_retention(retention, stream_age)
    if applied > retention:
        log.warning("TESSERA_CLAIM_RETENTION=%.0fs is shorter than the claims stream keeps its events (%.0fs);"
                    " released claims are kept %.0fs", retention, stream_age, applied)
    kv = await bus.kv(subjects.KV_CLAIMS)
    while True:
        try:
            result = await prune_once(kv, applied)
            if result.removed:
                log.info("pruned %d released claims older than %.0fs (%d live)", result.removed, applied, result.live)
        except (TemporaryError, nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("pruning released claims failed (%r); trying again in %.0fs", exc, interval)
        await asyncio.sleep(interval)
