"""Keeps a `FleetModel` current from the public buckets and the usage stream, by watching.

First a full read of the four buckets (the pull-consumer scan of tessera.shared.kvkeys, which has
no "empty bucket" race), then a watch of each bucket (its changes, in order, as they happen) and an
ordered consumer on the usage stream starting a little before now (usage is republished only on a
change or every heartbeat, so the last reports are in that window). Everything here is a read: the
read-only `viewer` identity suffices, and nothing is created but the consumers of the reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging

import nats.errors
from nats.js import api

from tessera.shared import subjects
from tessera.shared.bus import Bus
from tessera.shared.events import usage_decoder
from tessera.shared.kvkeys import live_entries

from tessera.cli.fleetmodel import FleetModel

log = logging.getLogger("tessera.cli.feed")

BUCKETS = (subjects.KV_INVENTORY, subjects.KV_LEDGER, subjects.KV_CLAIMS, subjects.KV_TENANTS)
# How far back the usage consumer starts: two of the enforcer's usage heartbeats (30 s each).
USAGE_LOOKBACK_SECONDS = 60.0


async def load(bus: Bus, model: FleetModel | None = None) -> FleetModel:
    """One complete read of the buckets into ``model`` (a new one if None)."""
    model = model or FleetModel()
    for bucket in BUCKETS:
        kv = await bus.kv(bucket)
        for key, (value, revision) in (await live_entries(kv)).items():
            model.apply(bucket, key, value, revision)
    return model


async def follow(bus: Bus, model: FleetModel, ready: asyncio.Event | None = None) -> None:
    """Load, then keep ``model`` current until cancelled."""
    await load(bus, model)
    watchers = [await (await bus.kv(b)).watchall() for b in BUCKETS]
    initial = [asyncio.Event() for _ in BUCKETS]
    tasks = [asyncio.create_task(_drain(b, w, model, caught_up), name=f"watch-{b}")
             for b, w, caught_up in zip(BUCKETS, watchers, initial)]
    # Ready means current: every watch has delivered the values its bucket held when it began, so
    # whatever was written before `follow` got here is in the model (a view drawn now shows it).
    caught_up = asyncio.ensure_future(asyncio.gather(*(e.wait() for e in initial)))
    usage_sub = None
    try:
        done, _ = await asyncio.wait([*tasks, caught_up], return_when=asyncio.FIRST_COMPLETED)
        if caught_up in done:
            usage_sub = await _follow_usage(bus, model)
            if ready is not None:
                ready.set()
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # a watch that ended raises here: the caller's root task ends with it
    finally:
        for task in (*tasks, caught_up):
            task.cancel()
        await asyncio.gather(*tasks, caught_up, return_exceptions=True)
        for w in watchers:
            with contextlib.suppress(Exception):
                await w.stop()
        if usage_sub is not None:
            with contextlib.suppress(Exception):
                await usage_sub.unsubscribe()


async def _drain(bucket: str, watcher, model: FleetModel, caught_up: asyncio.Event) -> None:
    async for entry in watcher:
        if entry is None:  # the end of the initial values
            caught_up.set()
            continue
        deleted = entry.operation in ("DEL", "PURGE")
        model.apply(bucket, entry.key, None if deleted else entry.value, entry.revision)


async def _follow_usage(bus: Bus, model: FleetModel):
    async def on_msg(msg) -> None:
        try:
            model.apply_usage(usage_decoder.decode(msg.data))
        except Exception:  # a report that does not decode is skipped (the enforcer's own consumers judge it)
            model.skipped["usage"] += 1

    start = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=USAGE_LOOKBACK_SECONDS)
    try:
        return await bus.subscribe_ordered(
            f"{subjects.USAGE}.>", stream=subjects.STREAM_USAGE, cb=on_msg,
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_TIME,
                                      opt_start_time=start.isoformat().replace("+00:00", "Z")),
        )
    except (nats.js.errors.NotFoundError, nats.errors.Error) as exc:
        # No usage stream yet (no enforcer has started): allocations are shown, usage is not.
        log.warning("not following usage: %r", exc)
        return None
