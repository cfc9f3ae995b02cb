"""The Kubernetes side of placement decisions, off the commit path.

Placement decides and commits in the ledger at NATS speed; writing a ResourceClaim's status and
lifting a pod's gate take API-server round trips, and the API server may be slow or down. So the
decision path only hands a job to this queue (claims that stand for a ResourceClaim only; nothing
else pays anything), and a few workers carry the jobs out:

- an allocation: write ``status.allocation`` (re-read and retry on a 409, a bounded number of times;
  a claim already showing this allocation is done), then lift the pod's gate, then say so on the
  pod. If that cannot be done for good — the claim is gone, the API server refuses the status, the
  conflicts never end, or the API server stays unreachable past the retry budget — the allocation
  is given back through the ordinary release path and the pod gets an ``AllocationFailed`` Event;
- an unschedulable claim: an Event and the pod condition with the reason; the gate stays;
- a recheck (the reconciler's, of a claim waiting for room or allocated and not yet running):
  nothing, unless another allocator wrote an allocation into it meanwhile (below).

A claim found showing an allocation placement did not write (kube-scheduler's own, after it took
placement's back; another allocator's; a person's) is never left beside the ledger's: it is adopted
into the ledger where it fits (`tessera.placement.adoption`; the gate is lifted and the pod told),
or else taken out of the claim with a Warning on the pod saying why, and placement's own allocation
written instead — or, where the pod was already bound to another node, given back, with what to do.

One claim's jobs run one at a time and a newer job replaces a queued older one. Nothing here is
remembered across restarts: on start placement re-queues every placed claim that stands for a
ResourceClaim (each step is idempotent), so a job lost with a stopped replica is done by the next.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.kubeapi import Rejected
from tessera.shared.events import DeviceShare
from tessera.shared.featuregates import FeatureGateOff, require_consumable_capacity
from tessera.shared.kubeclaims import DRIVER, KubeClaimRef

from tessera.placement.claimstatus import allocation, same_allocation

if TYPE_CHECKING:  # the adapter (and kubernetes_asyncio) is imported only in Kubernetes mode
    from tessera.placement.kube import KubeWriter

log = logging.getLogger("tessera.placement.kubesync")

CONFLICT_RETRIES = 10
REPORT_SECONDS = 10.0  # how long an Event or condition is retried: it informs, it decides nothing


@dataclass(frozen=True)
class Allocated:
    claim: str
    tenant: str
    node: str
    shares: list[DeviceShare]
    kube: KubeClaimRef
    models: dict[int, str] = field(default_factory=dict)  # GPU index -> model on the node


@dataclass(frozen=True)
class Unschedulable:
    claim: str
    kube: KubeClaimRef
    reason: str


@dataclass(frozen=True)
class Adopted:
    """What `tessera.placement.adoption` took into the ledger of another allocator's allocation."""

    node: str
    shares: list[DeviceShare]
    now: bool  # False: the ledger and the record said it already


@dataclass(frozen=True)
class Recheck:
    """A claim placement has not allocated, or allocated and its pod is not running yet: check
    that the ResourceClaim shows no allocation another allocator wrote (`_recheck`)."""

    claim: str
    kube: KubeClaimRef


Job = Allocated | Unschedulable | Recheck
GiveBack = Callable[[Allocated, str], Awaitable[None]]
# Adopt a claim's allocation another allocator wrote (the claim id and the allocation found):
# what was adopted, or why it cannot be.
Adopt = Callable[[str, dict], Awaitable["Adopted | str"]]


class ClaimStatusSync:
    def __init__(self, writer: KubeWriter, give_back: GiveBack, *, workers: int = 8,
                 retry_seconds: float = 60.0, max_backoff: float = 5.0, adopt: Adopt | None = None) -> None:
        """``adopt``: what takes another allocator's allocation into the ledger or says why not
        (None: such an allocation is left as it is, and ours given back)."""
        self.writer = writer
        self.give_back = give_back
        self.adopt = adopt
        self.workers = workers
        self.retry_seconds = retry_seconds
        self.max_backoff = max_backoff
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.latest: dict[str, Job] = {}  # claim -> its job not yet started
        self.queued_at: dict[str, float] = {}  # claim -> when that job was queued (its retry budget starts)
        self.locks: dict[str, tuple[asyncio.Lock, int]] = {}  # claim -> its lock, workers holding or awaiting it
        self.counts = {"written": 0, "given_back": 0, "reported": 0, "refused": 0}

    def submit(self, job: Job) -> None:
        """Queue ``job`` (never blocks): a queued job of the same claim is replaced by it (a check
        of a waiting claim replaces none: any other job of the claim is newer news)."""
        if isinstance(job, Recheck) and job.claim in self.latest:
            return
        if job.claim not in self.latest:
            self.queue.put_nowait(job.claim)
        self.latest[job.claim] = job
        self.queued_at[job.claim] = asyncio.get_running_loop().time()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as group:
            for i in range(self.workers):
                group.create_task(self._worker(), name=f"kube-status-{i}")

    async def _worker(self) -> None:
        while True:
            claim = await self.queue.get()
            job = self.latest.pop(claim, None)
            queued = self.queued_at.pop(claim, None)
            if job is None:
                continue
            assert queued is not None  # `submit` sets a claim's latest job and its queueing time together
            lock, users = self.locks.get(claim, (asyncio.Lock(), 0))
            self.locks[claim] = (lock, users + 1)
            try:
                async with lock:
                    if isinstance(job, Allocated):
                        await self._allocated(job, queued + self.retry_seconds)
                    elif isinstance(job, Recheck):
                        await self._recheck(job)
                    else:
                        await self._unschedulable(job)
            except Exception as exc:  # one claim's trouble must not stop the worker
                log.warning("Kubernetes update for %s failed: %r", claim, exc)
                if isinstance(job, Allocated):  # (the bus down while giving back?) neither written
                    self._again(job, queued)     # nor given back: try the whole job again shortly
            finally:
                lock, users = self.locks[claim]
                if users == 1:
                    del self.locks[claim]
                else:
                    self.locks[claim] = (lock, users - 1)

    def _again(self, job: Allocated, queued: float, delay: float = 1.0) -> None:
        """Queue ``job`` again after ``delay`` seconds with its first queueing time (its retry
        budget is not renewed), unless a newer job of the claim is waiting by then."""
        def requeue() -> None:
            if job.claim not in self.latest:
                self.submit(job)
                self.queued_at[job.claim] = queued

        asyncio.get_running_loop().call_later(delay, requeue)

    async def _retrying(self, deadline: float, step: Callable[[], Awaitable]):
        """Run ``step`` until it succeeds: now again after a conflict (a bounded number of times),
        with a growing delay while the API server is unreachable (until ``deadline``, loop time).
        Whatever cannot succeed ends as a PermanentError saying why."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        delay, conflicts, away = 0.05, 0, False
        while True:
            try:
                return await step()
            except ConflictError as exc:
                conflicts += 1
                if conflicts >= CONFLICT_RETRIES:
                    raise PermanentError(f"{exc}; still conflicting after {conflicts} attempts") from exc
            except Rejected as exc:
                # a 401/403 from an API server that was just unreachable: a restarted kube-apiserver
                # serves before it is ready and refuses everyone until its RBAC caches are filled
                if not away or exc.status not in (401, 403) or loop.time() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)
            except TemporaryError as exc:
                away = True
                if loop.time() + delay > deadline:
                    raise PermanentError(f"{exc}; gave up after {loop.time() - started:.0f}s of retries") from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff)

    # --- allocations -----------------------------------------------------------------------

    async def _allocated(self, job: Allocated, deadline: float) -> None:
        """``deadline`` (loop time) ends the retries: counted from when the job was queued, so that
        during an outage every waiting allocation is given back on time, not one worker-turn after
        another."""
        ref = job.kube
        try:
            written = await self._retrying(deadline, lambda: self._write_status(job))
        except PermanentError as exc:
            await self._fail(job, f"the allocation could not be written to ResourceClaim "
                                  f"{ref.namespace}/{ref.name}: {exc}", withdraw=False)
            return
        lifted = False
        if ref.pod:
            try:
                lifted = await self._retrying(deadline, lambda: self.writer.lift_gate(ref))
            except PermanentError as exc:
                await self._fail(job, f"the scheduling gate of pod {ref.namespace}/{ref.pod} could not be "
                                      f"lifted: {exc}", withdraw=True)
                return
        if isinstance(written, Adopted):
            if written.now or lifted:
                await self._report(ref, "AllocationAdopted", _adopted(ref, written), warning=False, placed=True)
            return
        if not (written or lifted):
            return  # the claim and the pod said it all already (a repeat, a peer's, a restart's)
        self.counts["written"] += 1
        devices = _devices(job.shares)
        message = f"ResourceClaim {ref.name} allocated on node {job.node}: {devices}"
        await self._report(ref, "Allocated", message, warning=False, placed=True)

    async def _write_status(self, job: Allocated) -> bool | Adopted:
        """Write our allocation into the claim: True if written now, False if it was there, or
        what was adopted of another allocator's allocation found there instead."""
        ref = job.kube
        claim = await self.writer.read_claim(ref)
        try:
            wanted = allocation(job.claim, job.node, job.shares, claim_spec=claim.get("spec"), models=job.models)
        except ValueError as exc:
            raise PermanentError(str(exc)) from exc
        current = (claim.get("status") or {}).get("allocation")
        if current:
            if same_allocation(current, wanted):
                return False  # written before (by us, a peer, or a write whose answer was lost)
            if self.adopt is None:
                raise PermanentError(f"it already shows another allocation ({_where(current)}), written by "
                                     f"another allocator")
            why = await self.adopt(job.claim, current)
            if isinstance(why, Adopted):
                await self.writer.protect(ref, claim)  # as kube-scheduler protects what it allocates
                return why
            claim = await self._refuse(job, claim, current, why)
        claim = await self.writer.protect(ref, claim)
        stored = await self.writer.write_allocation(ref, claim, wanted)
        try:
            require_consumable_capacity(f"ResourceClaim {ref.namespace}/{ref.name}",
                                        {"status": {"allocation": wanted}}, stored)
        except FeatureGateOff:
            # what the server kept is a whole-card allocation with no share: take it back before the
            # scheduler or the kubelet acts on it (the caller gives the GPUs back, naming the gate)
            await self.writer.write_allocation(ref, stored, None)
            raise
        return True

    async def _refuse(self, job: Allocated, claim: dict, found: dict, why: str) -> dict:
        """Take another allocator's allocation ``found`` (which cannot be adopted, ``why``) out of
        the claim; the claim as it is then, for ours to be written. PermanentError (placement's
        allocation is then given back) where the pod was bound to another node meanwhile: ours
        could never be prepared there."""
        stored, bound, refused = await self._take_out(job.claim, job.kube, claim, found, why)
        if bound and bound != job.node:
            raise PermanentError(f"{refused}; {_rebuild(bound)}")
        await self._report(job.kube, "AllocationRefused", f"{refused}; Tessera allocates the claim itself on node "
                                                          f"{job.node}", warning=True, placed=False)
        return stored

    async def _take_out(self, cid: str, ref: KubeClaimRef, claim: dict, found: dict,
                        why: str) -> tuple[dict, str | None, str]:
        """Remove ``found`` from the claim: (the claim as stored then, the node its pod is bound to
        if any, what was done and why, for the reports)."""
        pod = await self.writer.read_pod(ref) if ref.pod else None
        bound = ((pod or {}).get("spec") or {}).get("nodeName")
        stored = await self.writer.write_allocation(ref, claim, None)
        self.counts["refused"] += 1
        refused = (f"ResourceClaim {ref.name} was allocated by another allocator ({_where(found)}) and Tessera, "
                   f"the one allocator of {DRIVER} devices, refused that allocation and removed it: {why}")
        log.warning("%s: %s", cid, refused)
        return stored, bound, refused

    # --- rechecks --------------------------------------------------------------------------

    async def _recheck(self, job: Recheck) -> None:
        """The reconciler's check of a claim waiting for room, or allocated and not yet running: an
        allocation another allocator wrote into it meanwhile (kube-scheduler allocating it itself,
        a deallocation and a new allocation seen as one change, or missed) is adopted or refused;
        an allocation that is the claim's record's is left as it is."""
        ref = job.kube
        claim = await self.writer.read_claim(ref)
        found = (claim.get("status") or {}).get("allocation")
        if not found or self.adopt is None:
            return
        outcome = await self.adopt(job.claim, found)
        if isinstance(outcome, Adopted):
            await self.writer.protect(ref, claim)
            lifted = await self.writer.lift_gate(ref) if ref.pod else False
            if outcome.now or lifted:
                await self._report(ref, "AllocationAdopted", _adopted(ref, outcome), warning=False, placed=True)
            return
        _, bound, refused = await self._take_out(job.claim, ref, claim, found, outcome)
        then = _rebuild(bound) if bound else "Tessera allocates the claim itself once it fits"
        await self._report(ref, "AllocationRefused", f"{refused}; {then}", warning=True, placed=False)

    async def _withdraw(self, job: Allocated) -> None:
        """Take our allocation out of the claim's status again (before giving the GPUs back)."""
        claim = await self.writer.read_claim(job.kube)
        current = (claim.get("status") or {}).get("allocation")
        mine = allocation(job.claim, job.node, job.shares, claim_spec=claim.get("spec"), models=job.models)
        if current and same_allocation(current, mine):
            await self.writer.write_allocation(job.kube, claim, None)

    async def _fail(self, job: Allocated, reason: str, *, withdraw: bool) -> None:
        log.warning("%s: giving the allocation on %s back: %s", job.claim, job.node, reason)
        if withdraw:
            try:
                await self._retrying(self._soon(), lambda: self._withdraw(job))
            except PermanentError as exc:
                log.warning("%s: its allocation stays in the ResourceClaim's status: %s", job.claim, exc)
        await self.give_back(job, reason)
        self.counts["given_back"] += 1
        await self._report(job.kube, "AllocationFailed", f"GPUs given back: {reason}", warning=True, placed=False)

    @staticmethod
    def _soon() -> float:
        return asyncio.get_running_loop().time() + REPORT_SECONDS

    # --- reports ---------------------------------------------------------------------------

    async def _unschedulable(self, job: Unschedulable) -> None:
        await self._report(job.kube, "Unschedulable", f"ResourceClaim {job.kube.name}: {job.reason}",
                           warning=True, placed=False)

    async def _report(self, ref: KubeClaimRef, reason: str, message: str, *, warning: bool, placed: bool) -> None:
        """The Event and the pod condition; best effort (they inform, they decide nothing)."""
        try:
            await self._retrying(self._soon(), lambda: self.writer.report(ref, reason=reason, message=message,
                                                                          warning=warning))
            if ref.pod:
                await self._retrying(self._soon(), lambda: self.writer.set_condition(ref, placed, reason, message))
            self.counts["reported"] += 1
        except PermanentError as exc:
            log.warning("could not report %s on %s/%s: %s", reason, ref.namespace, ref.pod or ref.name, exc)


def _adopted(ref: KubeClaimRef, adopted: Adopted) -> str:
    return (f"ResourceClaim {ref.name} was allocated by another allocator on node {adopted.node}: "
            f"{_devices(adopted.shares)}; its devices were free, and Tessera's ledger holds them for this claim now")


def _rebuild(bound: str) -> str:
    return (f"the pod was bound to node {bound} with it, where Tessera's allocation cannot be prepared: delete "
            "and recreate the pod to have Tessera place it")


def _devices(shares: list[DeviceShare]) -> str:
    return ", ".join(f"gpu-{s.index} ({s.memory_mib} MiB, {s.cores}% cores)" for s in shares)


def _where(alloc: dict) -> str:
    results = ((alloc.get("devices") or {}).get("results")) or []
    return ", ".join(f"{r.get('pool')}/{r.get('device')}" for r in results) or "no devices"
