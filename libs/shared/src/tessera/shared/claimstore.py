"""The ``claims`` KV bucket: each claim's current state, moved forward only.

Events may arrive twice or late (at-least-once delivery, several replicas). A transition is applied
with compare-and-set and only if `tessera.shared.lifecycle` allows it, so a late ``allocated`` never
overwrites ``released``, and replaying a stream converges to the same records.
"""

from __future__ import annotations

from typing import Callable

import msgspec

from tessera.shared.bus import KeyValue
from tessera.shared.events import ClaimRecord, encode, now
from tessera.shared.jspub import kv_update_many
from tessera.shared.kv import Bucket
from tessera.shared.lifecycle import ALLOWED, TERMINAL, allowed

__all__ = ["ALLOWED", "TERMINAL", "ClaimStore"]


class ClaimStore:
    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self.bucket: Bucket[ClaimRecord] = Bucket(kv, ClaimRecord, "claims")

    async def get(self, claim: str) -> tuple[ClaimRecord | None, int | None]:
        """The record and its revision; (None, None) if absent. A malformed record raises BadValue
        (permanent: the message about it is dead-lettered with the key and the path)."""
        stored = await self.bucket.get(claim)
        return (stored.value, stored.revision) if stored else (None, None)

    async def create(self, record: ClaimRecord) -> int | None:
        """Store a new claim: its revision, or None if one with that id already exists (a retry)."""
        return await self.bucket.create(record.claim, record)

    async def replace(self, record: ClaimRecord, revision: int) -> int | None:
        """Write ``record`` if the stored one is still at ``revision``: its new revision, or None.

        The fast path of a writer that already knows the revision (placement learns it from the
        ``requested`` event): one round trip instead of a read and a write.
        """
        return await self.bucket.replace(record.claim, record, revision)

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
        self, claim: str, state: str, update: Callable[[ClaimRecord], ClaimRecord] | None = None,
        *, expect: Callable[[ClaimRecord], bool] | None = None,
    ) -> ClaimRecord | None:
        """Move ``claim`` to ``state`` if the lifecycle allows it (and ``expect``, when given, accepts
        the record as it is now); returns the new record, or None if not allowed."""
        outcome: list[ClaimRecord | None] = [None]

        def change(record: ClaimRecord | None) -> ClaimRecord | None:
            outcome[0] = None
            if record is None or not allowed(record.state, state) or (expect is not None and not expect(record)):
                return None
            new = msgspec.structs.replace(record, state=state, updated=now())
            outcome[0] = update(new) if update is not None else new
            return outcome[0]

        await self.bucket.modify(claim, change)
        return outcome[0]

    async def mark_release_requested(self, claim: str, reason: str) -> ClaimRecord | None:
        def change(record: ClaimRecord | None) -> ClaimRecord | None:
            if record is None or record.state in TERMINAL:
                return None
            return msgspec.structs.replace(record, release_requested=True, reason=reason, updated=now())

        return (await self.bucket.modify(claim, change))[0]

    async def all(self) -> list[ClaimRecord]:
        """Every stored claim, by id (read in batches); a malformed record is logged and skipped."""
        return [s.value for s in (await self.bucket.items()).values()]

    async def all_with_revisions(self) -> dict[str, tuple[ClaimRecord, int]]:
        return {k: (s.value, s.revision) for k, s in (await self.bucket.items()).items()}
