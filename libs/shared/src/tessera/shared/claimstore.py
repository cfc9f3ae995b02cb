"""The ``claims`` KV bucket: each claim's current state, moved forward only.

Events may arrive twice or late (at-least-once delivery, several replicas). A transition is applied
with compare-and-set and only if the state machine allows it, so a late ``allocated`` never
overwrites ``released``, and replaying a stream converges to the same records.
"""

from __future__ import annotations

from typing import Callable

import msgspec

from tessera.shared.bus import KeyNotFoundError, KeyValue, KeyWrongLastSequenceError
from tessera.shared.events import ClaimRecord, encode, now
from tessera.shared.jspub import kv_update_many
from tessera.shared.kvkeys import live_values

_decoder = msgspec.json.Decoder(ClaimRecord)

TERMINAL = frozenset({"released", "failed"})

ALLOWED: dict[str, frozenset[str]] = {
    "requested": frozenset({"allocated", "unschedulable", "released", "failed"}),
    "unschedulable": frozenset({"allocated", "unschedulable", "released", "failed"}),
    "allocated": frozenset({"prepared", "running", "released", "failed"}),
    "prepared": frozenset({"running", "released", "failed"}),
    "running": frozenset({"released", "failed"}),
    "released": frozenset(),
    "failed": frozenset({"released"}),
}


class ClaimStore:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self, claim: str) -> tuple[ClaimRecord | None, int | None]:
        try:
            entry = await self.kv.get(claim)
        except KeyNotFoundError:
            return None, None
        if not entry.value:
            return None, entry.revision
        return _decoder.decode(entry.value), entry.revision

    async def create(self, record: ClaimRecord) -> int | None:
        """Store a new claim: its revision, or None if one with that id already exists (a retry)."""
        try:
            return await self.kv.create(record.claim, encode(record))
        except Exception as exc:
            if "wrong last sequence" in str(exc).lower() or "key exists" in str(exc).lower():
                return None
            raise

    async def replace(self, record: ClaimRecord, revision: int) -> int | None:
        """Write ``record`` if the stored one is still at ``revision``: its new revision, or None.

        The fast path of a writer that already knows the revision (placement learns it from the
        ``requested`` event): one round trip instead of a read and a write.
        """
        try:
            return await self.kv.update(record.claim, encode(record), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def replace_many(self, items: list[tuple[ClaimRecord, int]]) -> list[int | None]:
        """``replace`` for many records at once, pipelined: new revisions, None where the CAS lost.

        The writes go out without waiting for each acknowledgement (a KV update is a publish on
        ``$KV.<bucket>.<key>`` with the expected last sequence), then the acks are gathered.
        """
        out: list[int | None] = []
        for result in await kv_update_many(self.kv, [(r.claim, encode(r), revision) for r, revision in items]):
            if isinstance(result, Exception):
                raise result
            out.append(result)
        return out

    async def transition(
        self, claim: str, state: str, update: Callable[[ClaimRecord], ClaimRecord] | None = None
    ) -> ClaimRecord | None:
        """Move ``claim`` to ``state`` if allowed; returns the new record, or None if not allowed."""
        while True:
            record, revision = await self.get(claim)
            if record is None:
                return None
            if record.state != state and state not in ALLOWED[record.state]:
                return None
            new = msgspec.structs.replace(record, state=state, updated=now())
            if update is not None:
                new = update(new)
            try:
                await self.kv.update(claim, encode(new), last=revision)
                return new
            except KeyWrongLastSequenceError:
                continue

    async def mark_release_requested(self, claim: str, reason: str) -> ClaimRecord | None:
        while True:
            record, revision = await self.get(claim)
            if record is None or record.state in TERMINAL:
                return record
            new = msgspec.structs.replace(record, release_requested=True, reason=reason, updated=now())
            try:
                await self.kv.update(claim, encode(new), last=revision)
                return new
            except KeyWrongLastSequenceError:
                continue

    async def all(self) -> list[ClaimRecord]:
        """Every stored claim, by id (read in batches, not one round trip per claim)."""
        return list((await live_values(self.kv, _decoder)).values())
