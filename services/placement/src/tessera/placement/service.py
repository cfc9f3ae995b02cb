"""The placement service: turns ``requested`` claims into ``allocated`` or ``unschedulable``.

Any number of replicas run at once. Each keeps an in-memory view of the fleet (watched from the
``inventory`` and ``ledger`` buckets), decides with the engine, and commits through compare-and-set:
the tenant's quota record first, then the node's ledger record, then the claim's record. Whoever loses
a race re-reads and tries again; a replica whose claim CAS loses rolls its ledger entry back, so a
claim is never allocated twice and no GPU is over-committed, without node locks between replicas.
So that two replicas never hold one claim on two nodes' ledgers even for a moment, no ledger entry
is written without a placing lease on the claim's record (`tessera.placement.lease`): the one-claim
path takes it first, the batch path takes those of a whole batch in one pipelined round (against
the revisions the ``requested`` events named) before its group commit.

Unschedulable claims are kept (in the ``claims`` bucket, mirrored here) and retried when capacity or
quota changes: an inventory change, a ledger release or a tenant update, never by polling. Every
replica follows every ``unschedulable`` event, so waiting claims do not depend on one replica.

Throughput comes from treating a fetched batch as a unit: fresh claims are decided one after another
in memory, the ledger is written once per node for the whole batch (group commit), and the claim
records and ``allocated`` events go out pipelined; anything unusual takes the one-claim path.

In Kubernetes mode (``TESSERA_KUBERNETES``) a claim that stands for a ResourceClaim (``kube`` set)
also has its outcome written to the cluster — the claim's ``status.allocation``, the pod's gate
lifted, Events — by `tessera.placement.kubesync`, after the commit and off its path; a write that
fails for good gives the allocation back through the ordinary release path. Such a claim is placed
only on a node where kube-scheduler's filters would let its pod be bound (`nodefilters`, over the
Nodes and pods `kube.ClusterWatch` follows into `clusternodes`), and one the scheduler took back all
the same is placed again (`deallocation`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Sequence

import msgspec

from tessera.shared import subjects
from tessera.shared.bus import BatchSubscription, Bus, Delivery
from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.events import (
    ClaimDeallocated,
    ClaimEvent,
    ClaimRecord,
    ClaimReleaseRequested,
    ClaimRequested,
    ClaimSpec,
    ClaimUnschedulable,
    GpuQuota,
    LedgerEntry,
    claim_decoder,
)
from tessera.shared.ledger import Ledger, claim_quota, held_by_tenant, summed, tenant_totals
from tessera.shared.lifecycle import ON_NODE, TERMINAL, owner_of
from tessera.shared.runner import ServiceContext
from tessera.shared.telemetry import claim_attributes, inject
from opentelemetry.trace import SpanKind

from tessera.placement import fairshare, idlework, lease, spans
from tessera.placement.clusternodes import NO_EXCLUSIONS, ClusterNodes, Exclusions, refused
from tessera.placement.adoption import Adoptions
from tessera.placement.deallocation import Deallocations
from tessera.placement.engine import COMPILED_CORE, Placement, Placer, Rejection, ledger_entry
from tessera.placement.commit import Booking, GroupCommit
from tessera.placement.fleet import Fleet
from tessera.placement.outcomes import Allocation, OutcomeWriter, Refusal
from tessera.placement.preempting import Preemptions, need_of
from tessera.placement.release import Releases
from tessera.placement.view import FleetView
from tessera.placement.quota import admit, has_limits
from tessera.placement.kubesync import Allocated, ClaimStatusSync, Recheck, Unschedulable
from tessera.placement.metrics import PlacementMetrics
from tessera.placement.reconcile import Reconciler
from tessera.placement.settings import PlacementSettings

log = logging.getLogger("tessera.placement")

CONFLICT_RETRIES = 20
# A batch still deciding after this fraction of ack_wait writes nothing on the unleased path.
LATE_FRACTION = 0.5



class PlacementService:
    def __init__(self, ctx: ServiceContext, settings: PlacementSettings, kube_api=None) -> None:
        """``kube_api``: the ``tessera.shared.kubeapi.KubeApi`` of Kubernetes mode (tests give one
        acting as placement's service account); by default one configured in-cluster or from
        ~/.kube/config."""
        self.ctx = ctx
        self.kube_api = kube_api
        self.bus: Bus = ctx.bus
        self.settings = settings
        self.fleet = Fleet()
        self.placer = Placer(
            self.fleet,
            default_node_policy=settings.default_policy,
            default_gpu_policy=settings.default_policy,
            fluid_memory=settings.fluid_memory,
            compiled={"auto": None, "compiled": True, "python": False}[settings.core],
            staged_mix=True,
        )
        self.claims: ClaimStore
        self.view = FleetView(self.fleet)
        # The view's tables, under the names the handling below reads them by.
        self.inventories = self.view.inventories
        self.node_ledgers = self.view.node_ledgers
        self.claim_nodes = self.view.claim_nodes
        self.quotas = self.view.quotas
        self.tenants_known = self.view.tenants_known
        self.tentative = self.view.tentative
        self.claim_locks: dict[str, asyncio.Lock] = {}
        # Set while no batch of claims is being handled: the work between decisions waits for it.
        self._handling = 0
        self._quiet = asyncio.Event()
        self._quiet.set()
        # Who holds a placing lease: unique per process (TESSERA_INSTANCE may be unset or shared).
        self.placer_id = f"{ctx.settings.instance or 'placement'}/{uuid.uuid4().hex[:12]}"
        self.pending: dict[str, ClaimRequested] = {}  # unschedulable, waiting for a change
        self.traces: dict[str, str] = {}  # pending claim -> traceparent, so a retry continues its trace
        self._retry_wanted = asyncio.Event()
        # What it decided, read by the log report and the metrics (plain ints: the hot path's cost).
        self.counts = {"allocated": 0, "unschedulable": 0, "conflicts": 0, "lost_races": 0, "retried": 0,
                       "withdrawn": 0, "adopted": 0}
        self.committer = GroupCommit(self.view, self.counts)
        self.outcomes = OutcomeWriter(self)
        self.releases = Releases(self)
        self.preemptions = Preemptions(self)
        self.kube: ClaimStatusSync | None = None
        # Kubernetes mode: the cluster's Nodes and pods, which kube-scheduler's filters read.
        self.cluster: ClusterNodes | None = None
        self._live: tuple[int, frozenset[str]] = (-1, frozenset())  # (fleet roster generation, its live nodes)
        self.adoptions = Adoptions(self)
        self.deallocations = Deallocations(self)
        self.reconciler = Reconciler(self, settings.reconcile_seconds, settings.reconcile_grace_seconds)
        self.metrics = PlacementMetrics(self, ctx.metrics, ctx.settings.metrics_legacy)

    @property
    def ledger(self) -> Ledger:
        return self.committer.ledger

    @ledger.setter
    def ledger(self, ledger: Ledger) -> None:
        self.committer.ledger = ledger

    # --- start-up --------------------------------------------------------------------------

    async def start(self) -> dict:
        self.ledger = Ledger(await self.bus.kv(subjects.KV_LEDGER))
        self.claims = ClaimStore(await self.bus.kv(subjects.KV_CLAIMS))
        open_inventory = self.ctx.gate("inventory")
        open_ledger = self.ctx.gate("ledger")
        open_tenants = self.ctx.gate("tenants")
        tasks = {}
        if self.settings.kubernetes:
            from tessera.placement.kube import ClusterWatch, KubeWriter  # only here: the client costs start-up time

            writer = KubeWriter(self.kube_api, timeout=self.settings.kube_timeout_seconds,
                                instance=self.ctx.settings.instance)
            self.kube = ClaimStatusSync(writer, self._give_back, workers=self.settings.kube_workers,
                                        retry_seconds=self.settings.kube_retry_seconds,
                                        adopt=self.adoptions.adopt_locked)
            tasks["kube-status"] = self._run_kube(self.kube, writer)
            # No decision before the Nodes and pods are in: a node the scheduler refuses is not offered.
            self.cluster = ClusterNodes()
            tasks["kube-nodes"] = ClusterWatch(writer.api, self.cluster, self._retry_wanted.set,
                                               self.ctx.gate("kube-nodes")).run()
        return tasks | {
            "watch-inventory": self._watch(subjects.KV_INVENTORY, self.view.on_inventory, open_inventory),
            "watch-ledger": self._watch(subjects.KV_LEDGER, self.view.on_ledger, open_ledger),
            "watch-tenants": self._watch(subjects.KV_TENANTS, self.view.on_tenant, open_tenants),
            "claims": self._consume_when_ready(),
            "retry-unschedulable": self._retry_loop(),
            "follow-unschedulable": self._follow_unschedulable(),
            "report": self._report(),
            "reconcile": self._reconcile_when_ready(),
            **({"between-decisions": self._idle_when_ready()} if self.settings.idle_work else {}),
        }

    async def _reconcile_when_ready(self) -> None:
        while not self.ctx.ready:  # repairs decide from the fleet view: it must be loaded
            await asyncio.sleep(0.05)
        await self.reconciler.run()

    async def _idle_when_ready(self) -> None:
        while not self.ctx.ready:  # (indexes are warmed over the loaded fleet)
            await asyncio.sleep(0.05)
        await idlework.run(self.placer, quiet=self._quiet)

    async def _run_kube(self, sync: ClaimStatusSync, writer) -> None:
        try:
            await sync.run()
        finally:
            await writer.close()

    async def _report(self, every: float = 5.0) -> None:
        """One INFO line per interval with what this replica decided (nothing when idle)."""
        last = dict(self.counts)
        while True:
            await asyncio.sleep(every)
            now = dict(self.counts)
            if now != last:
                delta = {k: now[k] - last[k] for k in now}
                log.info("last %.0fs: allocated %d, unschedulable %d, CAS conflicts %d; %d claims waiting",
                         every, delta["allocated"], delta["unschedulable"], delta["conflicts"], len(self.pending))
                last = now

    async def _watch(self, bucket: str, apply, open_gate) -> None:
        """Apply every current value of a bucket, open the gate, then follow updates forever."""
        kv = await self.bus.kv(bucket)
        watcher = await kv.watchall()
        try:
            async for entry in watcher:
                if entry is None:  # end of the initial values
                    open_gate()
                    continue
                try:
                    if apply(entry.key, entry.value, entry.revision, entry.operation):
                        self._retry_wanted.set()  # a waiting claim may fit now
                except Exception:  # one value we cannot apply must not stop the view from following
                    log.exception("cannot apply %s/%s at revision %d; skipped", bucket, entry.key, entry.revision)
        finally:
            await watcher.stop()

    async def _consume_when_ready(self) -> None:
        while not self.ctx.ready:  # the fleet view must be loaded before the first decision
            await asyncio.sleep(0.05)
        await self._load_pending()
        idlework.settle_collector()  # (the young passes then run between decisions: `idlework`)
        await self.bus.consume_batches(BatchSubscription(
            stream=subjects.STREAM_CLAIMS,
            durable="placement",
            filter_subjects=[subjects.claims_of_kind("requested"), subjects.claims_of_kind("release"),
                             subjects.claims_of_kind("deallocated")],
            decoder=claim_decoder,
            handler=self.handle_batch,
            batch=self.settings.batch,
        ))

    async def _follow_unschedulable(self) -> None:
        """Every replica retries every waiting claim, not only those it decided itself, so a claim
        does not wait for the replica that first saw it (which may be gone). Duplicated retries are
        harmless: the claim record's compare-and-set lets one win."""
        def waiting(event, headers) -> None:
            if not isinstance(event, ClaimUnschedulable):
                return
            if event.nominated is not None or event.claim in self.view.nominations:  # hold its victims' room
                self.view.nominate(event.claim, event.nominated)
            if event.claim not in self.pending:
                self.pending[event.claim] = ClaimRequested(claim=event.claim, tenant=event.tenant, spec=ClaimSpec())
                if "traceparent" in headers:
                    self.traces[event.claim] = headers["traceparent"]

        await self.bus.follow(subjects.claims_of_kind("unschedulable"), claim_decoder, waiting)

    async def _load_pending(self) -> None:
        """Reconcile: unschedulable claims recorded in the bucket are ours to retry."""
        for record in await self.claims.all():
            if record.state == "unschedulable" and not record.release_requested:
                self.pending[record.claim] = ClaimRequested(
                    claim=record.claim, tenant=record.tenant, spec=record.spec, kube=record.kube
                )
                self.traces[record.claim] = record.traceparent
                if record.nominated is not None:
                    self.view.nominate(record.claim, record.nominated)
            else:
                self._kube_resume(record)
        if self.pending:
            self._retry_wanted.set()

    # --- watched state ---------------------------------------------------------------------

    # --- handling --------------------------------------------------------------------------

    async def handle(self, event: ClaimEvent, delivery: Delivery) -> None:
        tenant, _, _, node = subjects.claim_subject_parts(delivery.subject)
        if event.tenant != tenant:  # a tenant may publish only under its own name
            raise PermanentError(f"{type(event).__name__} for tenant {event.tenant!r} published under {tenant!r}")
        match event:
            case ClaimRequested():
                if "traceparent" in delivery.headers:
                    self.traces[event.claim] = delivery.headers["traceparent"]
                await self.place(event)
            case ClaimReleaseRequested():
                await self.cancel(event, addressed=node != subjects.NO_NODE)
            case ClaimDeallocated():
                await self.deallocations.handle(event)
            case _:
                return

    def _fast(self, event, seen: set[str], delivery: Delivery) -> bool:
        """A fresh claim that needs nothing but a decision and four pipelined writes (lease, ledger,
        record, event).

        Only the translator's own ``requested`` (its msg-id; the stream drops a second copy), on
        its first delivery, whose record is at the revision the event names: a redelivery, a
        tenant's copy or a retry read the record first, on the one-claim path. Both paths lease the
        claim before its ledger write, so neither can race the other onto a second node."""
        subject = delivery.subject
        return (
            isinstance(event, ClaimRequested)
            and event.record_revision > 0
            and delivery.num_delivered == 1
            and delivery.headers.get("Nats-Msg-Id") == f"{event.claim}:requested"
            and subject.split(".", 3)[2] == event.tenant  # else the careful path refuses it
            and event.claim not in self.pending
            and event.claim not in self.claim_nodes
            and event.claim not in seen
            and event.tenant in self.tenants_known
            and not has_limits(self.quotas.get(event.tenant))
            and not (self.settings.preemption and event.spec.priority > 0 and event.spec.may_preempt)  # the one-claim path
        )

    async def handle_batch(self, items: Sequence[tuple[ClaimEvent, Delivery]]) -> list[BaseException | None]:
        """A fetched batch at once: decide fresh claims one by one in memory, then write the ledger
        once per node, the claim records and the ``allocated`` events pipelined. Everything else
        (releases, redeliveries, quota-limited tenants) takes the one-claim path.

        An error outside the per-claim handling (a pipelined write whose connection went) is the
        outcome of every claim not yet settled: they are redelivered, and each redelivery finds what
        this pass did get done. It never escapes, so it cannot end the consumer (and the process)."""
        outcomes: list[BaseException | None] = [None] * len(items)
        self._handling += 1
        self._quiet.clear()
        try:
            await self._handle_batch(items, outcomes)
        except Exception as exc:
            log.exception("placement batch of %d failed; its unsettled claims are redelivered", len(items))
            error = TemporaryError(f"placement batch failed: {exc!r}", delay=1.0)
            outcomes = [error if outcome is None else outcome for outcome in outcomes]
            self.view.unbook_all({event.claim for event, _ in items})
        finally:
            self._handling -= 1
            if not self._handling:
                self._quiet.set()
        return outcomes

    async def _handle_batch(self, items: Sequence[tuple[ClaimEvent, Delivery]],
                            outcomes: list[BaseException | None]) -> None:
        fetched = asyncio.get_running_loop().time()
        seen: set[str] = set()
        fast: list[int] = []
        slow: list[int] = []
        for i, (event, delivery) in enumerate(items):
            (fast if self._fast(event, seen, delivery) else slow).append(i)
            seen.add(event.claim)

        # The placing leases of the fresh claims go out first and their acknowledgements come back
        # while the claims are decided (in memory): the lease costs a write, not a round trip.
        for i in fast:
            event, delivery = items[i]
            if "traceparent" in delivery.headers:
                self.traces[event.claim] = delivery.headers["traceparent"]
        requested = [e for i in fast if isinstance(e := items[i][0], ClaimRequested)]
        assert len(requested) == len(fast)  # `_fast` takes only ClaimRequested
        leasing = await self._send_leases(requested)
        lost_races: list[int] = []
        try:
            decided: list[tuple[int, ClaimRequested, Placement | Rejection, LedgerEntry | None, dict[str, str]]] = []
            observe = self.metrics.decided_batch.observe
            for i, event in zip(fast, requested):
                delivery = items[i][1]
                with self.ctx.telemetry.span("placement handle requested", parent_headers=delivery.headers,
                                             kind=SpanKind.CONSUMER) as span:
                    started = time.perf_counter()
                    decision = self._decide(event.claim, event.tenant, event.spec, event.kube)
                    observe(time.perf_counter() - started)
                    spans.decided(self.placer, event, decision, span)
                    headers = inject({})
                entry = None
                if not isinstance(decision, Rejection):
                    entry = ledger_entry(event.claim, event.tenant, event.spec, decision, _pod_uid(event.kube))
                    self.view.book(decision.node, entry)
                decided.append((i, event, decision, entry, headers))
        finally:
            leased = await leasing  # also when deciding failed: no write is left unawaited

        booked: list[tuple[int, Allocation]] = []
        rejected: list[tuple[int, Refusal]] = []
        moved: set[str] = set()
        for (i, event, decision, entry, headers), (record, revision) in zip(decided, leased):
            if revision is None:  # the record moved (a peer leased it, a release): decide it again, leased
                lost_races.append(i)
                if entry is not None:
                    moved.add(event.claim)
            elif isinstance(decision, Rejection):  # (its entry is None)
                rejected.append((i, Refusal(event, decision.reason, decision.filtered, record, revision, headers)))
            else:
                assert entry is not None  # booked above for every placement
                booked.append((i, Allocation(event, decision.node, entry, record, revision, headers)))
        if moved:
            self.view.unbook_all(moved)

        if rejected:
            for (i, _), outcome in zip(rejected, await self.outcomes.unschedulable([r for _, r in rejected])):
                outcomes[i] = outcome
        if booked and asyncio.get_running_loop().time() - fetched > self.bus.settings.ack_wait * LATE_FRACTION:
            # Decided for so long (a stopped process, a starved loop) that the server may have given
            # these messages to a peer meanwhile: the one-claim path (which reads the record and
            # holds its lease anew) places them instead.
            log.warning("placement batch took %.1fs to decide; its %d fresh claims take the leased path",
                        asyncio.get_running_loop().time() - fetched, len(booked))
            self.view.unbook_all({a.event.claim for _, a in booked})
            lost_races += [i for i, _ in booked]
            booked = []
        committed = await self.committer.commit_booked([Booking(a.node, a.entry, a.record.placing_until)
                                                        for _, a in booked])
        writes: list[tuple[int, Allocation]] = []
        for (i, allocation), error in zip(booked, committed):
            if isinstance(error, ConflictError):
                lost_races.append(i)  # a peer took the space first: decide again below, in-process
            elif error is not None:
                outcomes[i] = error
            else:
                writes.append((i, allocation))
        if writes:
            for (i, _), allocated in zip(writes, await self.outcomes.allocated([a for _, a in writes])):
                if isinstance(allocated, BaseException):
                    outcomes[i] = allocated

        async def one(i: int, raise_conflict: bool = False) -> None:
            event, delivery = items[i]
            try:
                with self.ctx.telemetry.span(f"placement handle {subjects.event_name(delivery.subject)}",
                                             parent_headers=delivery.headers, kind=SpanKind.CONSUMER,
                                             attributes=claim_attributes(event)):
                    await self.handle(event, delivery)
            except ConflictError:
                if raise_conflict:
                    raise
                outcomes[i] = ConflictError(f"{event.claim}: compare-and-set kept losing")
            except Exception as exc:
                outcomes[i] = exc

        self.counts["lost_races"] += len(lost_races)
        for i in lost_races:
            # Retried here rather than by redelivery: losing races to a peer is normal and must
            # not use up the message's delivery budget (which ends in the dead-letter subject).
            for attempt in range(CONFLICT_RETRIES):
                try:
                    await one(i, raise_conflict=True)
                    break
                except ConflictError as exc:
                    if attempt == CONFLICT_RETRIES - 1:
                        outcomes[i] = exc
                    await asyncio.sleep(0.001 * attempt)
        for i in slow:  # in order: a release after a request in the same batch must see it
            await one(i)

    async def _send_leases(self, events: list[ClaimRequested]):
        """Send the placing lease of each fresh claim (one pipelined compare-and-set each, against
        the revision its ``requested`` named) and return an awaitable of (record as leased, its
        revision or None where the record had moved) per claim. So the batch path, like the
        one-claim path, writes a claim's ledger entry only while it alone places it (lease.py)."""
        now = time.time()
        marked = [lease.mark(self._requested_record(e), self.placer_id, now) for e in events]
        if not marked:
            async def nothing() -> list:
                return []
            return nothing()
        writes = asyncio.ensure_future(self.claims.replace_many([(m, e.record_revision) for m, e in zip(marked, events)]))
        await asyncio.sleep(0)  # the writes are queued on the connection ...
        await asyncio.sleep(0)  # ... and its flusher sends them while the batch is decided

        async def leased() -> list[tuple[ClaimRecord, int | None]]:
            return list(zip(marked, await writes))
        return leased()

    async def place(self, event: ClaimRequested) -> bool:
        """Allocate one claim; True if allocated. Idempotent: a redelivery finds the claim's state.

        Fast path: a fresh ``requested`` event names the revision of the claim's record, so the
        outcome is written with one compare-and-set against it; if anything changed the record
        since (a release request, a peer's decision), that CAS fails and the slow path re-reads.
        One claim is handled by one coroutine of this process at a time (the retry loop and the
        consumer may both hold it); peers are kept apart by the compare-and-set writes.
        """
        lock = self.claim_locks.setdefault(event.claim, asyncio.Lock())
        try:
            async with lock:
                return await self._place(event)
        finally:
            if not lock.locked() and not lock._waiters:
                self.claim_locks.pop(event.claim, None)

    async def _place(self, event: ClaimRequested) -> bool:
        if event.record_revision and event.claim not in self.pending:
            record = self._requested_record(event)
            revision: int | None = event.record_revision
        else:
            stored, revision = await self.claims.get(event.claim)
            if stored is None:
                record = ClaimRecord(claim=event.claim, tenant=event.tenant, state="requested", spec=event.spec,
                                     kube=event.kube)
                revision = await self.claims.create(record)
                if revision is None:
                    raise ConflictError(f"{event.claim} was created concurrently")
            else:
                record = stored
                if record.tenant != event.tenant:
                    raise PermanentError(f"claim {event.claim} belongs to tenant {record.tenant!r}, not "
                                         f"{event.tenant!r}: a tenant can only place its own claims (pick a claim "
                                         "id of your own)")
                if record.spec != event.spec or record.kube != event.kube:
                    # A peer's waiting claim: its record holds the spec and the ResourceClaim.
                    event = msgspec.structs.replace(event, spec=record.spec, kube=record.kube or event.kube)
                    if event.claim in self.pending:
                        self.pending[event.claim] = event
        assert revision is not None  # (ClaimStore.get gives a record with its revision)
        # From here until its outcome is written this replica alone places the claim (lease.py).
        record, revision = await lease.take(self.claims, self.placer_id, record, revision)
        if owner_of(record.state, "allocated") != "placement" or record.release_requested:
            log.debug("%s is %s: nothing to place", event.claim, record.state)
            spans.settled(event, "unchanged", f"the claim is {record.state}", placer=self.placer)
            self._forget(event.claim)
            self._kube_resume(record)  # a redelivery after a crash may find the cluster side unfinished
            return record.state not in TERMINAL

        existing = self.claim_nodes.get(event.claim)
        if existing is not None:  # committed before a crash or by a peer: finish, don't re-place
            # ... but only from the ledger as it is now, never from memory: the entry may have been
            # dropped since (an enforcer's orphan sweep), and allocating a claim with no entry sells
            # its GPU twice. Gone: place it afresh.
            ledger, at = await self.ledger.read_node(existing)
            self.view.remember(existing, ledger, at)
            entry = ledger.entries.get(event.claim)
            if entry is not None:
                spans.settled(event, "allocated", "already in the ledger", placer=self.placer, node=existing,
                              devices=entry.shares)
                await self._charge(event.tenant, event.claim, entry)
                return await self._finish(event, existing, entry, record, revision)

        if event.tenant not in self.tenants_known:
            reason = f"tenant {event.tenant!r} does not exist: create it with 'tessera tenant create'"
            spans.settled(event, "unschedulable", reason, placer=self.placer)
            await self._unschedulable(event, reason, {}, record, revision)
            return False

        if record.state == "unschedulable" and (record.nominated is not None or event.claim in self.view.nominations):
            self.view.nominate(event.claim, record.nominated)  # (a peer's, or from before a restart)
        started = time.perf_counter()
        with self.view.unheld(event.claim, event.spec.priority):  # the room held for it is its own
            decision = self._decide(event.claim, event.tenant, event.spec, event.kube or record.kube,
                                    record.withdrawn)
            if isinstance(decision, Placement) and event.claim in self.view.nominations:
                self.view.nominate(event.claim, None)  # placed: it takes the room, nothing more held
                record = msgspec.structs.replace(record, nominated=None)
        self.metrics.decided_single.observe(time.perf_counter() - started)
        spans.decided(self.placer, event, decision)
        if isinstance(decision, Rejection):
            preempting, nominated = await self.preemptions.attempt(event)
            reason = decision.reason if preempting is None else f"{decision.reason}; {preempting}"
            if nominated != record.nominated:
                record = msgspec.structs.replace(record, nominated=nominated)
                self.view.nominate(event.claim, nominated)
            await self._unschedulable(event, reason, decision.filtered, record, revision)
            return False
        assert isinstance(decision, Placement)
        entry = ledger_entry(event.claim, event.tenant, event.spec, decision, _pod_uid(event.kube or record.kube))
        quota = self.quotas.get(event.tenant)
        if has_limits(quota):
            usage, quota_revision = await self.ledger.read_tenant(event.tenant)
            if event.claim not in usage.claims:
                tenant = self.view.tenant_records.get(event.tenant)
                admitted = admit(quota, tenant.borrowing_limit if tenant is not None else None,
                                 tenant_totals(usage), claim_quota(entry), event.spec.preemptible)
                if isinstance(admitted, str):
                    spans.settled(event, "unschedulable", admitted, placer=self.placer)
                    await self._unschedulable(event, admitted, {"quota": 1}, record, revision)
                    return False
                if admitted.borrowing:  # beyond its guarantee: another tenant may reclaim it
                    entry = msgspec.structs.replace(entry, borrowing=True)
                await self.ledger.reserve_quota(event.tenant, event.claim, claim_quota(entry), usage, quota_revision)
        try:
            await self._commit(decision.node, entry, record.placing_until)
        except BaseException:
            # Whether the write landed is unknown (a timeout) or a peer holds the claim: give the
            # quota back only where no ledger entry of the claim is known. A committed write comes
            # back through the ledger watch, and the redelivery charges it again (`_charge`).
            if has_limits(quota) and event.claim not in self.claim_nodes:
                await self.ledger.return_quota(event.tenant, event.claim)
            raise
        return await self._finish(event, decision.node, entry, record, revision)

    def _decide(self, claim: str, tenant: str, spec: ClaimSpec, kube=None,
                withdrawn: Sequence[str] = ()) -> Placement | Rejection:
        """The engine's decision, in Kubernetes mode on the nodes where kube-scheduler could bind the
        claim's pod (its filters, `clusternodes`), and elsewhere than the nodes the scheduler took
        the claim back from while another fits."""
        cluster = self.cluster
        if (cluster is None or spec.pod is None) and not withdrawn:
            return self.placer.place(claim, tenant, spec)
        out, live = self._exclusions(spec, kube)
        avoid = out.nodes | {n for n in withdrawn if n in self.fleet.nodes}
        if avoid != out.nodes:
            first = self.placer.place(claim, tenant, spec, exclude_nodes=avoid)
            if isinstance(first, Placement):
                return first
        if not out.nodes:
            return self.placer.place(claim, tenant, spec)
        decision = self.placer.place(claim, tenant, spec, exclude_nodes=out.nodes)
        return refused(decision, out, len(live)) if isinstance(decision, Rejection) else decision

    def _exclusions(self, spec: ClaimSpec, kube=None) -> tuple[Exclusions, frozenset[str]]:
        """Kubernetes mode: the live nodes kube-scheduler would refuse the claim's pod on (its
        filters, `clusternodes`), and the live nodes; none refused elsewhere."""
        cluster = self.cluster
        if cluster is None or spec.pod is None:
            return NO_EXCLUSIONS, frozenset()
        roster = self.fleet.roster_generation
        if self._live[0] != roster:
            self._live = (roster, frozenset(name for name, node in self.fleet.nodes.items() if not node.lost))
        live = self._live[1]
        return cluster.exclusions(spec.pod, live, self.view.pod_nodes, own_pod=_pod_uid(kube), roster=roster), live

    def excluded_nodes(self, spec: ClaimSpec, kube=None) -> frozenset[str]:
        """The nodes the claim's pod cannot be bound to: no victims are chosen there."""
        return self._exclusions(spec, kube)[0].nodes

    def _requested_record(self, event: ClaimRequested) -> ClaimRecord:
        """The record a fresh ``requested`` event implies (the translator wrote it at ``record_revision``)."""
        return ClaimRecord(claim=event.claim, tenant=event.tenant, state="requested", spec=event.spec,
                           traceparent=self.traces.get(event.claim, ""), kube=event.kube)

    async def _commit(self, node: str, entry: LedgerEntry, leased_until: float | None = None) -> None:
        await self.committer.commit(node, entry, leased_until)

    async def _finish(self, event: ClaimRequested, node: str, entry: LedgerEntry,
                      record: ClaimRecord, revision: int | None) -> bool:
        """Write ``allocated`` (or give back what this attempt took); True if allocated."""
        [outcome] = await self.outcomes.allocated([Allocation(event, node, entry, record, revision)])
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def _unschedulable(self, event: ClaimRequested, reason: str, filtered: dict[str, int],
                             record: ClaimRecord, revision: int | None) -> None:
        first = event.claim not in self.pending
        [error] = await self.outcomes.unschedulable([Refusal(event, reason, filtered, record, revision, None, first)])
        if error is not None:
            raise error

    async def _charge(self, tenant: str, claim: str, entry: LedgerEntry) -> None:
        """Make sure a claim that holds a ledger entry is counted in its tenant's quota usage (a
        reservation given back after a write whose outcome was unknown, and that did land)."""
        if not has_limits(self.quotas.get(tenant)):
            return
        usage, revision = await self.ledger.read_tenant(tenant)
        if claim not in usage.claims:
            await self.ledger.reserve_quota(tenant, claim, claim_quota(entry), usage, revision)

    def _forget(self, claim: str) -> None:
        self.pending.pop(claim, None)
        self.traces.pop(claim, None)
        if claim in self.view.nominations:
            self.view.nominate(claim, None)

    # --- the Kubernetes side (kubesync does the work, off this path) ---------------------------

    def _kube_allocated(self, claim: str, tenant: str, node: str, shares, kube) -> None:
        if self.kube is None or kube is None:
            return
        inventory = self.inventories.get(node)
        models = {d.index: d.model for d in inventory.devices} if inventory else {}
        self.kube.submit(Allocated(claim=claim, tenant=tenant, node=node, shares=list(shares), kube=kube,
                                   models=models))

    def _kube_resume(self, record: ClaimRecord) -> None:
        """Finish the cluster side of a claim placed earlier (by a replica that may have stopped
        before it got there): each step is idempotent, and nothing is written or reported again
        where the claim and the pod already say it. The node side (prepared, running) does not
        prove the status was written: an enforcer may prepare on the ``allocated`` event alone."""
        if record.state in ON_NODE and not record.release_requested:
            self._kube_allocated(record.claim, record.tenant, record.node, record.devices, record.kube)

    def _kube_recheck(self, record: ClaimRecord) -> None:
        """Have the status sync check that no other allocator allocated this claim."""
        if self.kube is not None and record.kube is not None:
            self.kube.submit(Recheck(claim=record.claim, kube=record.kube))

    def _kube_unschedulable(self, claim: str, kube, reason: str) -> None:
        if self.kube is not None and kube is not None:
            self.kube.submit(Unschedulable(claim=claim, kube=kube, reason=reason))

    async def _give_back(self, job: Allocated, reason: str) -> None:
        await self.releases.unannounced(job, reason)

    async def cancel(self, event: ClaimReleaseRequested, addressed: bool = False) -> None:
        await self.releases.cancel(event, addressed)

    def retry_waiting(self) -> None:
        """Have the waiting (unschedulable) claims tried again soon."""
        self._retry_wanted.set()

    def waiting_in_order(self) -> list[ClaimRequested]:
        """The waiting claims in the order a retry pass tries them: by their tenants' fair-sharing
        share once placed, lowest first (0 within its guarantee: `fairshare`), then priority, then age."""
        records = self.view.tenant_records
        if not any(r.borrowing_limit is not None for r in records.values()):
            return sorted(self.pending.values(), key=lambda e: (-e.spec.priority, e.ts))
        fleet = fairshare.capacity(self.inventories.values())
        held = held_by_tenant(ledger for ledger, _ in self.node_ledgers.values())
        cards = [d for inv in self.inventories.values() for d in inv.devices]
        smallest = [min(cards, key=lambda d: d.memory_mib)] if cards else []

        def key(e: ClaimRequested) -> tuple:  # (a percent of memory, or a whole card: of the smallest card)
            amount = fairshare.amount_of(need_of(e.spec, smallest), smallest[0].memory_mib if smallest else 0)
            after = summed([held.get(e.tenant, GpuQuota()), amount])
            return (fairshare.share(records.get(e.tenant), after, fleet), -e.spec.priority, e.ts)

        return sorted(self.pending.values(), key=key)

    async def _retry_loop(self) -> None:
        """Retry unschedulable claims whenever something that could make them fit has changed."""
        while True:
            await self._retry_wanted.wait()
            await asyncio.sleep(0.05)  # coalesce a burst of changes into one pass
            self._retry_wanted.clear()
            waiting = self.waiting_in_order()
            for event in waiting:
                if event.claim not in self.pending:
                    continue
                self.counts["retried"] += 1
                trace = self.traces.get(event.claim)
                try:
                    with self.ctx.telemetry.span(
                        "placement retry", parent_headers={"traceparent": trace} if trace else None,
                        attributes=claim_attributes(event),
                    ):
                        await self.place(event)
                except ConflictError:
                    self._retry_wanted.set()
                except lease.ClaimBusy as exc:  # a peer is placing it: look again when its lease may end
                    asyncio.get_running_loop().call_later(exc.delay, self._retry_wanted.set)
                except Exception as exc:  # one bad claim must not stop the retries of the others
                    log.warning("retry of %s failed: %r", event.claim, exc)


def _pod_uid(kube) -> str:
    """The uid of the pod a ResourceClaim's claim was made for ("" for any other claim)."""
    return kube.pod_uid if kube is not None else ""


async def build(ctx: ServiceContext, settings: PlacementSettings) -> dict:
    if COMPILED_CORE and settings.core != "python":
        log.info("policy %s; fragmentation-aware scoring by the compiled core", settings.default_policy)
    elif settings.core == "python":
        log.info("policy %s; fragmentation-aware scoring by the Python engine (TESSERA_PLACEMENT_CORE=python)",
                 settings.default_policy)
    else:
        log.warning("policy %s; the compiled core (tessera.placement._fgdcore) is not built here: the "
                    "Python engine makes the same decisions, several times slower (reinstall "
                    "services/placement where gcc and the Python headers are present)", settings.default_policy)
    return await PlacementService(ctx, settings).start()
