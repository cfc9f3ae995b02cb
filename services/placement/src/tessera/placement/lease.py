"""The placing lease: one replica at a time decides a claim on the slow path.

Two replicas handling one claim at once (both retrying a waiting claim, a redelivery racing the
first delivery, a tenant's duplicate ``requested``) each wrote it into their own node's ledger; the
claim record's compare-and-set then let one win and the loser rolled its entry back, but for those
revisions the claim held capacity on two nodes. The ledger is one key per node, so no write to one
node can be fenced by another's; the claim record is the one key both replicas share. Before it
writes a ledger entry, the slow path marks the record as being placed by this replica (by
compare-and-set, so exactly one of two racing replicas gets it); a peer that finds a live mark
leaves the claim alone until it is written or the mark runs out (the holder may have died).

Both paths hold it: the one-claim path takes it with `take` (read, then mark), the batch path
marks every fresh claim of a batch in one pipelined round against the revision the translator's
``requested`` named (`mark`). The group commit refuses an entry whose lease has too little left
(`WRITE_MARGIN`), so no replica writes a ledger entry for a claim another may hold by then.
"""

from __future__ import annotations

import time

import msgspec

from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import ConflictError, TemporaryError
from tessera.shared.events import ClaimRecord
from tessera.shared.lifecycle import UNPLACED

# Longer than a decision and its ledger write take, even on a loaded machine; a holder that died
# keeps its claim waiting this long.
LEASE_SECONDS = 10.0
# A peer that keeps moving the record between our read and our write: give up after this many.
ATTEMPTS = 5
# A ledger write is planned only while at least this much of its claim's lease is left: a holder
# slower than that (a stopped process) writes nothing, its peer may be placing the claim by then.
WRITE_MARGIN = 2.0


class ClaimBusy(TemporaryError):
    """Another replica is placing this claim: try again once its lease may have run out."""


def mark(record: ClaimRecord, me: str, now: float | None = None) -> ClaimRecord:
    """``record`` leased to ``me`` from ``now`` (written by compare-and-set, by the caller)."""
    return msgspec.structs.replace(record, placer=me, placing_until=(time.time() if now is None else now) + LEASE_SECONDS)


def live(placing_until: float | None, now: float | None = None) -> bool:
    """May a ledger entry be written under a lease running until ``placing_until``? (None: no lease
    to honour, the caller is a test or a tool.)"""
    return placing_until is None or (time.time() if now is None else now) < placing_until - WRITE_MARGIN


def unleased(record: ClaimRecord) -> ClaimRecord:
    """``record`` without a placing lease (what an outcome writes: the decision is over)."""
    if not record.placer and not record.placing_until:
        return record
    return msgspec.structs.replace(record, placer="", placing_until=0.0)


async def take(claims: ClaimStore, me: str, record: ClaimRecord, revision: int) -> tuple[ClaimRecord, int]:
    """Mark ``record`` (read at ``revision``) as being placed by ``me``; the record as marked and
    its revision. ClaimBusy if a peer holds a live lease. A claim that moved on meanwhile (placed
    or released) comes back as it is now, unmarked: there is nothing to place, the caller sees why."""
    for _ in range(ATTEMPTS):
        if record.state not in UNPLACED or record.release_requested:
            return record, revision
        now = time.time()
        if record.placer and record.placer != me and record.placing_until > now:
            raise ClaimBusy(f"{record.claim} is being placed by {record.placer}",
                            delay=max(0.1, record.placing_until - now))
        marked = mark(record, me, now)
        written = await claims.replace(marked, revision)
        if written is not None:
            return marked, written
        current, at = await claims.get(record.claim)
        if current is None or at is None:
            raise ConflictError(f"{record.claim}: its record went while it was being leased")
        record, revision = current, at
    raise ConflictError(f"{record.claim}: its record kept moving while it was being leased")
