"""Leak policy: which claims on this node to release, and which leftover processes to stop.

Decided from one NodeView (see observe.py) plus the time each condition was first seen, never from
memory that must survive a restart: a restarted enforcer starts its clocks again, so every bound is
"grace period + one look" from the moment the enforcer is up.

The rules, for claims allocated to this node:
- A claim made by `tessera run` (id ``run-...``) is in use while its owner holds ``owner.lock``.
  Without an owner for the grace period it is released; processes still in its accounting file lost
  the party that forwards their signals and gives the claim back, so they are killed first.
- Any other claim that has been declared ``running`` is in use while its owner lives or a process in
  its accounting file lives; with neither for the grace period it is released.
- Any other ``prepared`` claim is a reservation (``tessera submit``): held until released.
- An unreadable accounting file counts as in use: nothing is released on a guess.
A claim to be released (its release requested, or reclaimed by the rules above) is released only once
no process of it is left: until then its ledger entry stands for GPU memory that is really in use.
Its processes get SIGTERM, then SIGKILL once the grace period is over (at once where the owner is
gone: nobody is left to forward a signal or wait for them), and the release follows the first look
that finds none alive (kernel locks, see processes.py). `stopping` is that rule for one claim.
Janitor rules, for what the claims bucket no longer calls live here:
- its processes get SIGTERM once, then SIGKILL after the grace period; then its directory is removed;
- a ledger entry whose claim is released, failed or unknown for the grace period is removed.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

from tessera.enforcer.observe import ClaimView, NodeView

from tessera.shared.lifecycle import TERMINAL
from tessera.shared.workload import RUN_CLAIM_PREFIX as RUN_PREFIX


@dataclass(frozen=True)
class Release:
    claim: str  # no process of it is left: its record, quota and ledger entry go
    reason: str


@dataclass(frozen=True)
class Signal:
    claim: str
    sig: int


@dataclass(frozen=True)
class Cleanup:
    claim: str  # remove the directory (and CDI spec); nothing lives in it any more


@dataclass(frozen=True)
class DropLedger:
    claim: str  # a ledger entry with no live claim behind it


Action = Release | Signal | Cleanup | DropLedger


def in_use(cv: ClaimView) -> bool | None:
    """True/False for a workload claim; None for a reservation the leak rules do not apply to."""
    record = cv.record
    assert record is not None
    if cv.error:
        return True
    if cv.claim.startswith(RUN_PREFIX):
        return cv.owner
    if record.state == "running":
        return cv.owner or bool(cv.processes)
    return None


@dataclass
class Reclaimer:
    grace: float  # how long an idle claim is kept
    stop_grace: float  # how long a claim's processes get between SIGTERM and SIGKILL
    # (claim, condition) -> when it was first seen; forgotten as soon as the condition stops
    since: dict[tuple[str, str], float] = field(default_factory=dict)

    def _held(self, key: tuple[str, str], now: float, seen: set) -> float:
        seen.add(key)
        return now - self.since.setdefault(key, now)

    def stopping(self, cv: ClaimView, reason: str, *, kill_now: bool = False, now: float | None = None,
                 seen: set | None = None) -> list[Action]:
        """What releasing this claim takes now: its release where no process of it is left; else
        SIGTERM on the first look, SIGKILL once ``stop_grace`` has passed since (``kill_now``: at
        once), and nothing in between; for a pod's claim nothing but the wait (its containers are
        in another pid namespace: the kubelet stops them, with the pod's grace period). An unreadable accounting file hides whether any is left:
        nothing is released on a guess (the next look tries again)."""
        now = time.monotonic() if now is None else now
        seen = set() if seen is None else seen
        if cv.error:
            seen.add((cv.claim, "stopping"))  # (its clock keeps running)
            return []
        if not cv.processes:
            return [Release(cv.claim, reason)]
        if cv.record is not None and cv.record.kube is not None:
            return []  # a pod's containers: the kubelet stops them (an eviction's grace period), not us
        if kill_now:
            return [Signal(cv.claim, signal.SIGKILL)]
        first = (cv.claim, "stopping") not in self.since
        held = self._held((cv.claim, "stopping"), now, seen)
        if first:
            return [Signal(cv.claim, signal.SIGTERM)]
        return [Signal(cv.claim, signal.SIGKILL)] if held >= self.stop_grace else []

    def decide(self, view: NodeView, now: float | None = None) -> list[Action]:
        now = time.monotonic() if now is None else now
        seen: set[tuple[str, str]] = set()
        actions: list[Action] = []
        for claim, cv in view.claims.items():
            record = cv.record
            if record is not None and record.node == view.node and cv.live:  # a live claim of this node
                if record.release_requested:
                    actions += self.stopping(cv, record.reason or "requested", now=now, seen=seen)
                    continue
                if record.state == "allocated":
                    continue  # the consumer prepares it; nothing to reclaim yet
                use = in_use(cv)
                if use is None or use:
                    continue
                if self._held((claim, "idle"), now, seen) >= self.grace:
                    owner_gone = claim.startswith(RUN_PREFIX) or record.state == "running"
                    reason = "owner gone" if claim.startswith(RUN_PREFIX) else "workload ended"
                    actions += self.stopping(cv, f"reclaimed: {reason}", kill_now=owner_gone, now=now, seen=seen)
                continue
            # Not (or no longer) a live claim of this node.
            if cv.directory is not None:
                if cv.processes:
                    held = self._held((claim, "stale-procs"), now, seen)
                    if held == 0:
                        actions.append(Signal(claim, signal.SIGTERM))
                    elif held >= self.stop_grace:
                        actions.append(Signal(claim, signal.SIGKILL))
                elif not cv.error:
                    actions.append(Cleanup(claim))
            if cv.in_ledger:
                terminal = record is not None and record.state in TERMINAL
                if terminal or self._held((claim, "ledger-orphan"), now, seen) >= self.grace:
                    actions.append(DropLedger(claim))
        for key in list(self.since):
            if key not in seen:
                del self.since[key]
        return actions
