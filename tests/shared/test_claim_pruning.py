"""Released claims leave the claims bucket after their retention; nothing live ever does.

Against a real nats-server: the pruner removes released records older than the retention (the
bucket really shrinks: no marker is left), keeps younger ones and every claim that is not over,
never removes a key written again after it read it (the purge is fenced by revision), and works
under the translator's own NATS identity (the one service allowed to purge the bucket).
"""

from __future__ import annotations

import time

import msgspec
import nats.errors
import pytest

from tessera.shared import claimpruning, identities, subjects
from tessera.shared.bus import Bus
from tessera.shared.events import ClaimRecord, ClaimSpec
from tessera.shared.kvkeys import live_entries, live_keys
from tessera.shared.natsserver import NatsServer
from tessera.shared.settings import BusSettings

DAY = 24 * 3600.0
RETENTION = 7 * DAY
NOW = time.time()


def record(claim: str, state: str, age: float) -> bytes:
    return msgspec.json.encode(ClaimRecord(claim=claim, tenant="alpha", state=state, spec=ClaimSpec(),
                                           updated=NOW - age))


async def claims_bucket(url: str, service: str = "cli", **identity):
    bus = await Bus.connect(BusSettings(url=url, **identity), service)
    await bus.ensure_topology()
    return bus, await bus.kv(subjects.KV_CLAIMS)


async def test_released_claims_past_retention_are_removed_and_nothing_else(nats_url):
    bus, kv = await claims_bucket(nats_url)
    try:
        await kv.put("old-released", record("old-released", "allocated", 9 * DAY))
        await kv.put("old-released", record("old-released", "released", 8 * DAY))  # two revisions
        await kv.put("new-released", record("new-released", "released", 1 * DAY))
        await kv.put("old-running", record("old-running", "running", 30 * DAY))
        await kv.put("old-failed", record("old-failed", "failed", 30 * DAY))  # may still be released
        await kv.put("old-unschedulable", record("old-unschedulable", "unschedulable", 30 * DAY))
        result = await claimpruning.prune_once(kv, RETENTION, now=NOW)
        assert (result.removed, result.kept, result.live) == (1, 1, 3)
        assert await live_keys(kv) == ["new-released", "old-failed", "old-running", "old-unschedulable"]
        # Gone from the stream too (history and all, no delete marker left behind).
        info = await bus.stream_info(f"KV_{subjects.KV_CLAIMS}", subjects_filter=f"$KV.{subjects.KV_CLAIMS}.>")
        assert "$KV.claims.old-released" not in (info.state.subjects or {})
        assert (await claimpruning.prune_once(kv, RETENTION, now=NOW)).removed == 0
    finally:
        await bus.close()


async def test_a_claim_written_again_after_the_pruner_read_it_is_kept(nats_url, monkeypatch):
    """The window: the pruner reads a released record; before its purge, the key is written again
    (a new submit reusing the id). The purge is fenced at the revision read, so the new one stays."""
    bus, kv = await claims_bucket(nats_url)
    try:
        await kv.put("c1", record("c1", "released", 8 * DAY))
        stale = await live_entries(kv)
        revision = await kv.put("c1", record("c1", "requested", 0))

        async def snapshot_before_the_write(_kv, timeout=10.0):
            return stale

        monkeypatch.setattr(claimpruning, "live_entries", snapshot_before_the_write)
        result = await claimpruning.prune_once(kv, RETENTION, now=NOW)
        assert (result.removed, result.kept) == (0, 1)
        entry = await kv.get("c1")
        assert entry.revision == revision
        assert msgspec.json.decode(entry.value, type=ClaimRecord).state == "requested"
    finally:
        await bus.close()


def test_the_retention_never_undercuts_the_claims_stream():
    """A record must outlive every event about it, or a redelivered 'requested' would recreate it."""
    assert claimpruning.effective_retention(3600.0, RETENTION) == RETENTION
    assert claimpruning.effective_retention(30 * DAY, RETENTION) == 30 * DAY


async def test_the_translator_identity_may_prune_and_placement_may_not(tmp_path):
    auth = tmp_path / "auth"
    passwords = identities.write_auth_dir(auth, [])
    server = NatsServer(tmp_path / "store", config_file=auth / "nats.conf").start()
    try:
        operator, kv = await claims_bucket(server.url, user=identities.OPERATOR,
                                           password=passwords[identities.OPERATOR])
        await kv.put("c1", record("c1", "released", 8 * DAY))
        await kv.put("c2", record("c2", "released", 8 * DAY))
        await operator.close()
        translator = await Bus.connect(BusSettings(url=server.url, user="translator",
                                                   password=passwords["translator"]), "translator")
        placement = await Bus.connect(BusSettings(url=server.url, user="placement",
                                                  password=passwords["placement"]), "placement")
        try:
            with pytest.raises(nats.errors.TimeoutError):  # the server drops the purge: no permission
                await claimpruning.prune_once(await placement.kv(subjects.KV_CLAIMS), RETENTION, now=NOW)
            result = await claimpruning.prune_once(await translator.kv(subjects.KV_CLAIMS), RETENTION, now=NOW)
            assert result.removed == 2
        finally:
            await translator.close()
            await placement.close()
    finally:
        server.stop()
