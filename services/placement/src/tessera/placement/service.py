"""The placement service: turns ``requested`` claims into ``allocated`` or ``unschedulable``.

Any number of replicas run at once. Each keeps an in-memory view of the fleet (watched from the
``inventory`` and ``ledger`` buckets), decides with the engine, and commits through compare-and-set:
the tenant's quota record first, then the node's ledger record, then the claim's record. Whoever loses
a race re-reads and tries again; a replica whose claim CAS loses rolls its ledger entry back, so a
claim is never allocated twice and no GPU is over-committed, without node locks between replicas.

Unschedulable claims are kept (in the ``claims`` bucket, mirrored here) and retried when capacity or
quota changes: an inventory change, a ledger release or a tenant update, never by polling. Every
replica follows every ``unschedulable`` event, so waiting claims do not depend on one replica.

Throughput comes from treating a fetched batch as a unit: fresh claims are decided one after another
in memory, the ledger is written once per node for the whole batch (group commit), and the claim
records and ``allocated`` events go out pipelined; anything unusual takes the one-claim path.

In Kubernetes mode (``TESSERA_KUBERNETES``) a claim that stands for a ResourceClaim (``kube`` set)
also has its outcome written to the cluster — the claim's ``status.allocation``, the pod's gate
lifted, Events — by `tessera.placement.kubesync`, after the commit and off its path; a write that
fails for good gives the allocation back through the ordinary release path.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from dataclasses import dataclass
from typing import Mapping

import msgspec

from tessera.shared import subjects
from tessera.shared.bus import Bus, Delivery
from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import ConflictError, PermanentError, TemporaryError
from tessera.shared.events import (
    ClaimAllocated,
    ClaimRecord,
    ClaimReleased,
    ClaimReleaseRequested,
    ClaimRequested,
    ClaimSpec,
    ClaimUnschedulable,
    GpuQuota,
    LedgerEntry,
    NodeInventory,
    NodeLedger,
    TenantRecord,
    claim_decoder,
)
from tessera.shared.inventory import is_lost
from tessera.shared.kv import Codec
from tessera.shared.ledger import Ledger, check_fit, claim_quota, tenant_totals
from tessera.shared.lifecycle import ON_NODE, UNPLACED, release_route
from tessera.shared.runner import ServiceContext
from tessera.shared.telemetry import inject
from tessera.shared.settings import ConfigError, env_bool, env_choice, env_float, env_int

from tessera.placement.engine import COMPILED_CORE, Placement, Placer, Rejection
from tessera.placement.fleet import Fleet
from tessera.placement.quota import has_limits, over_quota
from tessera.placement.kubesync import Allocated, ClaimStatusSync, Unschedulable
from tessera.placement.reconcile import Reconciler

log = logging.getLogger("tessera.placement")

CONFLICT_RETRIES = 20

POLICIES = ("binpack", "spread", "fragmentation-aware", "best-fit")
CORES = ("auto", "compiled", "python")

_inventories: Codec[NodeInventory] = Codec(NodeInventory, subjects.KV_INVENTORY)
_tenants: Codec[TenantRecord] = Codec(TenantRecord, subjects.KV_TENANTS)
_node_ledgers: Codec[NodeLedger] = Codec(NodeLedger, subjects.KV_LEDGER)


@dataclass(frozen=True)
class PlacementSettings:
    default_policy: str = "fragmentation-aware"
    concurrency: int = 32
    batch: int = 256
    # The host-memory term of the fragmentation model: better packing (openb: 4.33% unallocated
    # instead of 4.64%), about 2.5x the decision time.
    fluid_memory: bool = True
    # Which fragmentation-aware scoring runs: the compiled core where it is built (auto), the compiled
    # core or refuse to start (compiled), or the Python reference engine (python): same decisions.
    core: str = "auto"
    # Kubernetes mode: write ResourceClaim allocations, lift pod gates, report on pods.
    kubernetes: bool = False
    kube_workers: int = 8
    # How long a ResourceClaim status write (or gate lift) is retried while the API server is
    # unreachable before the allocation is given back; and the limit on one API call.
    kube_retry_seconds: float = 60.0
    kube_timeout_seconds: float = 10.0
    # The reconciler (tessera.placement.reconcile): how often it checks placement's invariants, and
    # how old a record or ledger entry must be before it is repaired (younger: maybe mid-commit).
    reconcile_seconds: float = 30.0
    reconcile_grace_seconds: float = 30.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "PlacementSettings":
        env = os.environ if env is None else env
        settings = cls(
            default_policy=env_choice(env, "TESSERA_PLACEMENT_POLICY", cls.default_policy, POLICIES),
            concurrency=env_int(env, "TESSERA_PLACEMENT_CONCURRENCY", cls.concurrency, minimum=1),
            batch=env_int(env, "TESSERA_PLACEMENT_BATCH", cls.batch, minimum=1),
            fluid_memory=env_bool(env, "TESSERA_PLACEMENT_FLUID_MEMORY", cls.fluid_memory),
            core=env_choice(env, "TESSERA_PLACEMENT_CORE", cls.core, CORES),
            kubernetes=env_bool(env, "TESSERA_KUBERNETES", cls.kubernetes),
            kube_workers=env_int(env, "TESSERA_PLACEMENT_KUBE_WORKERS", cls.kube_workers, minimum=1),
            kube_retry_seconds=env_float(env, "TESSERA_PLACEMENT_KUBE_RETRY_SECONDS", cls.kube_retry_seconds),
            kube_timeout_seconds=env_float(env, "TESSERA_PLACEMENT_KUBE_TIMEOUT_SECONDS", cls.kube_timeout_seconds),
            reconcile_seconds=env_float(env, "TESSERA_PLACEMENT_RECONCILE_SECONDS", cls.reconcile_seconds),
            reconcile_grace_seconds=env_float(env, "TESSERA_PLACEMENT_RECONCILE_GRACE_SECONDS",
                                              cls.reconcile_grace_seconds),
        )
        if settings.reconcile_seconds <= 0:
            raise ConfigError(f"TESSERA_PLACEMENT_RECONCILE_SECONDS={settings.reconcile_seconds:g} must be above 0, "
                              "e.g. 30")
        if settings.reconcile_grace_seconds < 0:
            raise ConfigError(f"TESSERA_PLACEMENT_RECONCILE_GRACE_SECONDS={settings.reconcile_grace_seconds:g} is "
                              "negative; set the seconds a record may be mid-commit, e.g. 30")
        if settings.kube_retry_seconds < 0:
            raise ConfigError(f"TESSERA_PLACEMENT_KUBE_RETRY_SECONDS={settings.kube_retry_seconds:g} is negative; "
                              "set the seconds to keep retrying, e.g. 60")
        if settings.kube_timeout_seconds <= 0:
            raise ConfigError(f"TESSERA_PLACEMENT_KUBE_TIMEOUT_SECONDS={settings.kube_timeout_seconds:g} must be "
                              "above 0, e.g. 10")
        return settings


class PlacementService:
    def __init__(self, ctx: ServiceContext, settings: PlacementSettings) -> None:
        self.ctx = ctx
        self.bus: Bus = ctx.bus
        self.settings = settings
        self.fleet = Fleet()
        self.placer = Placer(
            self.fleet,
            default_node_policy=settings.default_policy,
            default_gpu_policy=settings.default_policy,
            fluid_memory=settings.fluid_memory,
            compiled={"auto": None, "compiled": True, "python": False}[settings.core],
        )
        self.ledger: Ledger
        self.claims: ClaimStore
        # node -> (ledger as last read or written, its revision)
        self.node_ledgers: dict[str, tuple[NodeLedger, int | None]] = {}
        self.claim_nodes: dict[str, str] = {}
        self.inventories: dict[str, NodeInventory] = {}
        self.quotas: dict[str, GpuQuota] = {}
        self.tenants_known: set[str] = set()
        self.claim_locks: dict[str, asyncio.Lock] = {}
        self.tentative: dict[str, dict[str, LedgerEntry]] = {}  # node -> claim -> entry in flight
        self.commit_queues: dict[str, list[tuple[LedgerEntry, asyncio.Future]]] = {}
        self.flushing: set[str] = set()
        self.pending: dict[str, ClaimRequested] = {}  # unschedulable, waiting for a change
        self.traces: dict[str, str] = {}  # pending claim -> traceparent, so a retry continues its trace
        self._retry_wanted = asyncio.Event()
        self.counts = {"allocated": 0, "unschedulable": 0, "conflicts": 0}
        self.kube: ClaimStatusSync | None = None
        self.reconciler = Reconciler(self, settings.reconcile_seconds, settings.reconcile_grace_seconds)

    # --- start-up --------------------------------------------------------------------------

    async def start(self) -> dict:
        self.ledger = Ledger(await self.bus.kv(subjects.KV_LEDGER))
        self.claims = ClaimStore(await self.bus.kv(subjects.KV_CLAIMS))
        open_inventory = self.ctx.gate("inventory")
        open_ledger = self.ctx.gate("ledger")
        open_tenants = self.ctx.gate("tenants")
        consumer_ready = asyncio.Event()
        tasks = {}
        if self.settings.kubernetes:
            from tessera.placement.kube import KubeWriter  # only here: the client costs start-up time

            writer = KubeWriter(timeout=self.settings.kube_timeout_seconds, instance=self.ctx.settings.instance)
            self.kube = ClaimStatusSync(writer, self._give_back, workers=self.settings.kube_workers,
                                        retry_seconds=self.settings.kube_retry_seconds)
            tasks["kube-status"] = self._run_kube(writer)
        return tasks | {
            "watch-inventory": self._watch(subjects.KV_INVENTORY, self._on_inventory, open_inventory),
            "watch-ledger": self._watch(subjects.KV_LEDGER, self._on_ledger, open_ledger),
            "watch-tenants": self._watch(subjects.KV_TENANTS, self._on_tenant, open_tenants),
            "claims": self._consume_when_ready(consumer_ready),
            "retry-unschedulable": self._retry_loop(),
            "follow-unschedulable": self._follow_unschedulable(),
            "report": self._report(),
            "reconcile": self._reconcile_when_ready(),
        }

    async def _reconcile_when_ready(self) -> None:
        while not self.ctx.ready:  # repairs decide from the fleet view: it must be loaded
            await asyncio.sleep(0.05)
        await self.reconciler.run()

    async def _run_kube(self, writer) -> None:
        try:
            await self.kube.run()
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
                    apply(entry.key, entry.value, entry.revision, entry.operation)
                except Exception:  # one value we cannot apply must not stop the view from following
                    log.exception("cannot apply %s/%s at revision %d; skipped", bucket, entry.key, entry.revision)
        finally:
            await watcher.stop()

    async def _consume_when_ready(self, ready: asyncio.Event) -> None:
        while not self.ctx.ready:  # the fleet view must be loaded before the first decision
            await asyncio.sleep(0.05)
        await self._load_pending()
        # What is loaded now (the fleet, imports) lives as long as the process: keep the cyclic
        # collector from walking it again and again, and let it run less often between batches (the
        # engine's memo tables churn many small tuples; there are hardly any cycles to find).
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
        await self.bus.consume(
            stream=subjects.STREAM_CLAIMS,
            durable="placement",
            filter_subjects=[subjects.claims_of_kind("requested"), subjects.claims_of_kind("release")],
            decoder=claim_decoder,
            handler=self.handle,
            batch=self.settings.batch,
            concurrency=self.settings.concurrency,
            ready=ready,
            batch_handler=self.handle_batch,
        )

    async def _follow_unschedulable(self) -> None:
        """Every replica retries every waiting claim, not only those it decided itself, so a claim
        does not wait for the replica that first saw it (which may be gone). Duplicated retries are
        harmless: the claim record's compare-and-set lets one win."""
        def waiting(event, headers) -> None:
            if isinstance(event, ClaimUnschedulable) and event.claim not in self.pending:
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
            else:
                self._kube_resume(record)
        if self.pending:
            self._retry_wanted.set()

    # --- watched state ---------------------------------------------------------------------

    def _on_inventory(self, key: str, value: bytes | None, revision: int, op) -> None:
        if op in ("DEL", "PURGE") or not value:
            self.inventories.pop(key, None)
            self.fleet.remove_node(key)
        else:
            inv = _inventories.decode_or_skip(key, value)
            if inv is None:
                return
            self.inventories[inv.node] = inv
            self.fleet.upsert_node(inv)
            if is_lost(inv):
                self.fleet.mark_lost(inv.node)
            known = self.node_ledgers.get(inv.node)
            if known is not None:
                self._apply_to_fleet(inv.node, known[0])
        self._retry_wanted.set()

    def _on_ledger(self, key: str, value: bytes | None, revision: int, op) -> None:
        if not key.startswith("node."):
            if key.startswith("tenant."):
                self._retry_wanted.set()
            return
        node = key[5:]
        known = self.node_ledgers.get(node)
        if known is not None and known[1] is not None and known[1] >= revision:
            return  # our own write, already applied: skip decoding it
        if op in ("DEL", "PURGE") or not value:
            ledger = NodeLedger(node=node)
        else:
            ledger = _node_ledgers.decode_or_skip(key, value)
            if ledger is None:
                return  # keep what we knew; a commit to this node re-reads (and refuses) it
        released = known is not None and any(c not in ledger.entries for c in known[0].entries)
        self._remember(node, ledger, revision)
        if released:
            self._retry_wanted.set()

    def _on_tenant(self, key: str, value: bytes | None, revision: int, op) -> None:
        if op in ("DEL", "PURGE") or not value:
            self.quotas.pop(key, None)
            self.tenants_known.discard(key)
        else:
            record = _tenants.decode_or_skip(key, value)
            if record is None:
                return
            self.quotas[record.tenant] = record.quota
            self.tenants_known.add(record.tenant)
        self._retry_wanted.set()

    def _remember(self, node: str, ledger: NodeLedger, revision: int | None) -> None:
        old = self.node_ledgers.get(node)
        if old is not None:
            for claim in old[0].entries:
                if claim not in ledger.entries and self.claim_nodes.get(claim) == node:
                    del self.claim_nodes[claim]
        for claim in ledger.entries:
            self.claim_nodes[claim] = node
        self.node_ledgers[node] = (ledger, revision)
        self._apply_to_fleet(node, ledger)

    def _apply_to_fleet(self, node: str, ledger: NodeLedger) -> None:
        if node not in self.inventories:
            return
        extra = self.tentative.get(node)
        if extra:
            entries = dict(ledger.entries)
            entries.update(extra)
            ledger = NodeLedger(node=node, entries=entries)
        held = self.fleet.nodes.get(node)
        if held is not None and held.entries == ledger.entries:
            return  # (our own write coming back: the view already holds it)
        self.fleet.apply_ledger(ledger)

    # --- handling --------------------------------------------------------------------------

    async def handle(self, event, delivery: Delivery) -> None:
        tenant, _, _, node = subjects.claim_subject_parts(delivery.subject)
        if getattr(event, "tenant", tenant) != tenant:  # a tenant may publish only under its own name
            raise PermanentError(f"{type(event).__name__} for tenant {event.tenant!r} published under {tenant!r}")
        match event:
            case ClaimRequested():
                if "traceparent" in delivery.headers:
                    self.traces[event.claim] = delivery.headers["traceparent"]
                await self.place(event)
            case ClaimReleaseRequested():
                await self.cancel(event, addressed=node != subjects.NO_NODE)
            case _:
                return

    def _fast(self, event, seen: set[str], subject: str) -> bool:
        """A fresh claim that needs nothing but a decision and three pipelined writes."""
        return (
            isinstance(event, ClaimRequested)
            and event.record_revision > 0
            and subject.split(".", 3)[2] == event.tenant  # else the careful path refuses it
            and event.claim not in self.pending
            and event.claim not in self.claim_nodes
            and event.claim not in seen
            and event.tenant in self.tenants_known
            and not has_limits(self.quotas.get(event.tenant))
        )

    async def handle_batch(self, items: list) -> list[BaseException | None]:
        """A fetched batch at once: decide fresh claims one by one in memory, then write the ledger
        once per node, the claim records and the ``allocated`` events pipelined. Everything else
        (releases, redeliveries, quota-limited tenants) takes the one-claim path.

        An error outside the per-claim handling (a pipelined write whose connection went) is the
        outcome of every claim not yet settled: they are redelivered, and each redelivery finds what
        this pass did get done. It never escapes, so it cannot end the consumer (and the process)."""
        outcomes: list[BaseException | None] = [None] * len(items)
        try:
            await self._handle_batch(items, outcomes)
        except Exception as exc:
            log.exception("placement batch of %d failed; its unsettled claims are redelivered", len(items))
            error = TemporaryError(f"placement batch failed: {exc!r}", delay=1.0)
            outcomes = [error if outcome is None else outcome for outcome in outcomes]
            self._unbook({getattr(event, "claim", "") for event, _ in items})
        return outcomes

    def _unbook(self, claims: set[str]) -> None:
        """Forget local bookings of ``claims`` that never reached the ledger (the view shows the ledger)."""
        for node, booked in self.tentative.items():
            if claims & booked.keys():
                for claim in claims & booked.keys():
                    del booked[claim]
                known = self.node_ledgers.get(node)
                self._apply_to_fleet(node, known[0] if known else NodeLedger(node=node))

    async def _handle_batch(self, items: list, outcomes: list[BaseException | None]) -> None:
        seen: set[str] = set()
        fast, slow = [], []
        for i, (event, delivery) in enumerate(items):
            (fast if self._fast(event, seen, delivery.subject) else slow).append(i)
            seen.add(getattr(event, "claim", ""))

        booked: list[tuple[int, ClaimRequested, LedgerEntry, dict[str, str]]] = []
        rejected: list[tuple[int, ClaimRequested, Rejection, dict[str, str]]] = []
        for i in fast:
            event, delivery = items[i]
            if "traceparent" in delivery.headers:
                self.traces[event.claim] = delivery.headers["traceparent"]
            with self.ctx.telemetry.span("placement handle requested", parent_headers=delivery.headers,
                                         attributes={"tessera.claim": event.claim}):
                decision = self.placer.place(event.claim, event.tenant, event.spec)
                headers = inject({})
                if isinstance(decision, Rejection):
                    rejected.append((i, event, decision, headers))
                    continue
            entry = LedgerEntry(claim=event.claim, tenant=event.tenant, shares=list(decision.shares),
                                cpu_millis=event.spec.cpu_millis, host_memory_mib=event.spec.host_memory_mib)
            self.fleet.commit(decision.node, entry)
            self.tentative.setdefault(decision.node, {})[entry.claim] = entry
            booked.append((i, event, entry, headers, decision.node))

        if rejected:
            await self._unschedulable_many(rejected, outcomes)
        committed = await self._commit_booked([(node, entry) for _, _, entry, _, node in booked])
        writes = []
        lost_races = []
        for (i, event, entry, headers, node), error in zip(booked, committed):
            if isinstance(error, ConflictError):
                lost_races.append(i)  # a peer took the space first: decide again below, in-process
                continue
            if error is not None:
                outcomes[i] = error
                continue
            record = ClaimRecord(claim=event.claim, tenant=event.tenant, state="allocated", spec=event.spec,
                                 node=node, devices=list(entry.shares), traceparent=self.traces.get(event.claim, ""),
                                 kube=event.kube)
            writes.append((i, event, entry, headers, node, record))
        revisions = await self.claims.replace_many([(w[5], w[1].record_revision) for w in writes]) if writes else []
        announce = []
        for (i, event, entry, headers, node, record), revision in zip(writes, revisions):
            if revision is None:  # the record moved (a release request?): the careful path decides
                try:
                    base = ClaimRecord(claim=event.claim, tenant=event.tenant, state="requested", spec=event.spec,
                                       kube=event.kube)
                    await self._finish(event, node, entry, base, None)
                except Exception as exc:
                    outcomes[i] = exc
                continue
            self._forget(event.claim)
            self.counts["allocated"] += 1
            self._kube_allocated(event.claim, event.tenant, node, entry.shares, event.kube)
            announce.append((subjects.claim(event.tenant, event.claim, "allocated", node),
                             ClaimAllocated(claim=event.claim, tenant=event.tenant, node=node,
                                            devices=list(entry.shares), spec=event.spec),
                             f"{event.claim}:allocated", headers))
        if announce:
            await self.bus.publish_many(announce)

        async def one(i: int, raise_conflict: bool = False) -> None:
            event, delivery = items[i]
            try:
                with self.ctx.telemetry.span(f"placement handle {subjects.event_name(delivery.subject)}",
                                             parent_headers=delivery.headers,
                                             attributes={"tessera.claim": getattr(event, "claim", "")}):
                    await self.handle(event, delivery)
            except ConflictError:
                if raise_conflict:
                    raise
                outcomes[i] = ConflictError(f"{getattr(event, 'claim', '?')}: compare-and-set kept losing")
            except Exception as exc:
                outcomes[i] = exc

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

    async def _unschedulable_many(self, rejected: list, outcomes: list) -> None:
        """Record and announce a batch's rejections with pipelined writes (a full fleet rejects a lot)."""
        now = time.time()
        records = []
        for i, event, decision, _ in rejected:
            self.pending[event.claim] = event
            self.counts["unschedulable"] += 1
            records.append((ClaimRecord(claim=event.claim, tenant=event.tenant, state="unschedulable",
                                        spec=event.spec, reason=decision.reason, kube=event.kube,
                                        traceparent=self.traces.get(event.claim, ""), updated=now),
                            event.record_revision))
        revisions = await self.claims.replace_many(records)
        announce = []
        for (i, event, decision, headers), revision in zip(rejected, revisions):
            if revision is None:  # the record moved: the careful one-claim path decides
                record = ClaimRecord(claim=event.claim, tenant=event.tenant, state="requested", spec=event.spec,
                                     kube=event.kube)
                try:
                    await self._unschedulable(event, decision.reason, decision.filtered, record, None)
                except Exception as exc:
                    outcomes[i] = exc
                continue
            self._kube_unschedulable(event.claim, event.kube, decision.reason)
            announce.append((subjects.claim(event.tenant, event.claim, "unschedulable"),
                             ClaimUnschedulable(claim=event.claim, tenant=event.tenant, reason=decision.reason,
                                                filtered=decision.filtered), None, headers))
        if announce:
            await self.bus.publish_many(announce)

    async def _commit_booked(self, booked: list[tuple[str, LedgerEntry]]) -> list[BaseException | None]:
        """Group-commit entries already booked in the local view: one ledger write per node."""
        loop = asyncio.get_running_loop()
        futures = []
        for node, entry in booked:
            done = loop.create_future()
            self.commit_queues.setdefault(node, []).append((entry, done))
            futures.append(done)
        # Nodes another coroutine is flushing: its flusher takes our entries too.
        await self._drain([n for n in dict.fromkeys(node for node, _ in booked) if n not in self.flushing])
        results = await asyncio.gather(*futures, return_exceptions=True)
        touched = set()
        out: list[BaseException | None] = []
        for (node, entry), result in zip(booked, results):
            self.tentative.get(node, {}).pop(entry.claim, None)
            if isinstance(result, BaseException):
                touched.add(node)
                out.append(result if isinstance(result, Exception) else ConflictError(str(result)))
            else:
                out.append(None)
        for node in touched:  # undo the local booking of what did not make it into the ledger
            known = self.node_ledgers.get(node)
            self._apply_to_fleet(node, known[0] if known else NodeLedger(node=node))
        return out

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
            record = ClaimRecord(claim=event.claim, tenant=event.tenant, state="requested", spec=event.spec,
                                 traceparent=self.traces.get(event.claim, ""), kube=event.kube)
            revision: int | None = event.record_revision
        else:
            record, revision = await self.claims.get(event.claim)
            if record is None:
                record = ClaimRecord(claim=event.claim, tenant=event.tenant, state="requested", spec=event.spec,
                                     kube=event.kube)
                revision = await self.claims.create(record)
                if revision is None:
                    raise ConflictError(f"{event.claim} was created concurrently")
            elif record.tenant != event.tenant:
                raise PermanentError(f"claim {event.claim} belongs to tenant {record.tenant!r}, not {event.tenant!r}: "
                                     "a tenant can only place its own claims (pick a claim id of your own)")
            elif record.spec != event.spec or record.kube != event.kube:
                # A peer's waiting claim: its record holds the spec and the ResourceClaim.
                event = msgspec.structs.replace(event, spec=record.spec, kube=record.kube or event.kube)
                if event.claim in self.pending:
                    self.pending[event.claim] = event
        if record.state not in ("requested", "unschedulable") or record.release_requested:
            log.debug("%s is %s: nothing to place", event.claim, record.state)
            self._forget(event.claim)
            self._kube_resume(record)  # a redelivery after a crash may find the cluster side unfinished
            return record.state not in ("released", "failed")

        existing = self.claim_nodes.get(event.claim)
        if existing is not None:  # committed before a crash or by a peer: finish, don't re-place
            # ... but only from the ledger as it is now, never from memory: the entry may have been
            # dropped since (an enforcer's orphan sweep), and allocating a claim with no entry sells
            # its GPU twice. Gone: place it afresh.
            ledger, at = await self.ledger.read_node(existing)
            self._remember(existing, ledger, at)
            entry = ledger.entries.get(event.claim)
            if entry is not None:
                await self._charge(event.tenant, event.claim, entry)
                return await self._finish(event, existing, entry, record, revision)

        if event.tenant not in self.tenants_known:
            await self._unschedulable(
                event, f"tenant {event.tenant!r} does not exist: create it with 'tessera tenant create'", {},
                record, revision,
            )
            return False

        decision = self.placer.place(event.claim, event.tenant, event.spec)
        if isinstance(decision, Rejection):
            await self._unschedulable(event, decision.reason, decision.filtered, record, revision)
            return False
        assert isinstance(decision, Placement)
        entry = LedgerEntry(
            claim=event.claim,
            tenant=event.tenant,
            shares=list(decision.shares),
            cpu_millis=event.spec.cpu_millis,
            host_memory_mib=event.spec.host_memory_mib,
        )
        quota = self.quotas.get(event.tenant)
        if has_limits(quota):
            usage, quota_revision = await self.ledger.read_tenant(event.tenant)
            if event.claim not in usage.claims:
                reason = over_quota(quota, tenant_totals(usage), claim_quota(entry))
                if reason:
                    await self._unschedulable(event, reason, {"quota": 1}, record, revision)
                    return False
                await self.ledger.reserve_quota(event.tenant, event.claim, claim_quota(entry), usage, quota_revision)
        try:
            await self._commit(decision.node, entry)
        except BaseException:
            # Whether the write landed is unknown (a timeout) or a peer holds the claim: give the
            # quota back only where no ledger entry of the claim is known. A committed write comes
            # back through the ledger watch, and the redelivery charges it again (`_charge`).
            if has_limits(quota) and event.claim not in self.claim_nodes:
                await self.ledger.return_quota(event.tenant, event.claim)
            raise
        return await self._finish(event, decision.node, entry, record, revision)

    async def _commit(self, node: str, entry: LedgerEntry) -> None:
        """Write ``entry`` into the node's ledger by CAS, after checking it still fits there.

        The entry is booked in the local view first, so that concurrent decisions in this process
        see it. Commits to one node are grouped: while one write is in flight, entries for that node
        queue up and go out together in the next write (group commit), so a hot node costs one
        round trip per batch rather than per claim, and our own writes never conflict.
        """
        self.fleet.commit(node, entry)
        self.tentative.setdefault(node, {})[entry.claim] = entry
        done = asyncio.get_running_loop().create_future()
        self.commit_queues.setdefault(node, []).append((entry, done))
        try:
            if node not in self.flushing:
                await self._drain([node])
            await done
        except BaseException:
            self.tentative.get(node, {}).pop(entry.claim, None)
            known = self.node_ledgers.get(node)
            self._apply_to_fleet(node, known[0] if known else NodeLedger(node=node))
            raise
        self.tentative.get(node, {}).pop(entry.claim, None)

    async def _drain(self, nodes: list[str]) -> None:
        """Write the entries queued for ``nodes`` into their ledgers until no more are queued.

        Each pass checks every queued entry still fits on its node and sends one compare-and-set
        write per node, all pipelined; a node whose ledger moved (a peer wrote it) is re-read and
        tried again, up to three times. Entries queued meanwhile by other coroutines go out in the
        next pass, so our own writes to one node never race each other.
        """
        self.flushing.update(nodes)
        attempts: dict[str, int] = {}
        work = {n: self.commit_queues.pop(n) for n in nodes if self.commit_queues.get(n)}
        try:
            while work:
                writes = []
                for node, batch in work.items():
                    ledger, revision = self.node_ledgers.get(node, (NodeLedger(node=node), None))
                    inventory = self.inventories.get(node)
                    entries = dict(ledger.entries)
                    accepted, refused = [], []
                    for entry, done in batch:
                        candidate = NodeLedger(node=node, entries=entries)
                        why = ("node left the fleet" if inventory is None
                               else check_fit(inventory.devices, candidate, entry))
                        if why is None:
                            entries[entry.claim] = entry
                            accepted.append(done)
                        else:
                            refused.append((done, f"{entry.claim} no longer fits on {node}: {why}"))
                    writes.append((node, batch, NodeLedger(node=node, entries=entries), revision, accepted, refused))
                sent = [w for w in writes if w[4]]
                results = await self.ledger.write_nodes([(w[2], w[3]) for w in sent]) if sent else []
                outcome = dict(zip((w[0] for w in sent), results))
                retry: dict[str, list] = {}
                for node, batch, new, revision, accepted, refused in writes:
                    result = outcome.get(node, revision)
                    if isinstance(result, ConflictError):
                        self.counts["conflicts"] += 1
                        attempts[node] = attempts.get(node, 0) + 1
                        if attempts[node] < 3:
                            ledger, at = await self.ledger.read_node(node)
                            self._remember(node, ledger, at)
                            retry[node] = batch
                            continue
                    if isinstance(result, Exception):
                        for _, done in batch:
                            if not done.done():
                                done.set_exception(result)
                        continue
                    if accepted:
                        self._remember(node, new, result)
                    for done in accepted:
                        if not done.done():
                            done.set_result(None)
                    for done, why in refused:
                        if not done.done():
                            done.set_exception(ConflictError(why))
                for node in nodes:  # what others queued for our nodes while we wrote
                    queued = self.commit_queues.pop(node, None)
                    if queued:
                        retry[node] = retry.get(node, []) + queued
                work = retry
        except BaseException as exc:
            # Everything still waiting on these nodes fails with it, also what others queued since
            # (no flusher is left to take it); an ordinary error is the claims' outcome, not ours.
            error = exc if isinstance(exc, Exception) else ConflictError(str(exc))
            for node in nodes:
                for _, done in work.get(node, []) + self.commit_queues.pop(node, []):
                    if not done.done():
                        done.set_exception(error)
            if not isinstance(exc, Exception):
                raise
        finally:
            self.flushing.difference_update(nodes)

    async def _finish(self, event: ClaimRequested, node: str, entry: LedgerEntry,
                      record: ClaimRecord, revision: int | None) -> bool:
        allocated = msgspec.structs.replace(
            record, state="allocated", node=node, devices=list(entry.shares), reason="", updated=time.time()
        )
        written = await self.claims.replace(allocated, revision) if revision else None
        while written is None:  # the record moved since we read it: decide again from what it says now
            current, revision = await self.claims.get(event.claim)
            if current is None or current.state not in ("requested", "unschedulable") or current.release_requested:
                if current is not None and current.node == node and current.state in ("allocated", "prepared", "running"):
                    break  # our own earlier write (a redelivery after a crash): just say it again
                # A peer allocated it elsewhere, or it was released meanwhile: give back what we took,
                # our entry only (not a peer's), and the quota only if the claim lives nowhere (the
                # reservation is the claim's, so a winner's would go with it).
                live = current is not None and current.state in ON_NODE
                await self.ledger.give_back(event.tenant, event.claim, node, shares=list(entry.shares), quota=not live)
                self._forget(event.claim)
                return False
            allocated = msgspec.structs.replace(
                current, state="allocated", node=node, devices=list(entry.shares), reason="", updated=time.time()
            )
            written = await self.claims.replace(allocated, revision)
        self._forget(event.claim)
        self.counts["allocated"] += 1
        self._kube_allocated(event.claim, event.tenant, node, entry.shares, event.kube or allocated.kube)
        await self.bus.publish(
            subjects.claim(event.tenant, event.claim, "allocated", node),
            ClaimAllocated(
                claim=event.claim, tenant=event.tenant, node=node, devices=list(entry.shares), spec=event.spec
            ),
            msg_id=f"{event.claim}:allocated",
        )
        return True

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

    async def _unschedulable(self, event: ClaimRequested, reason: str, filtered: dict[str, int],
                             record: ClaimRecord, revision: int | None) -> None:
        first = event.claim not in self.pending
        self.pending[event.claim] = event
        self.counts["unschedulable"] += 1
        if record.state == "unschedulable" and record.reason == reason and not first:
            return  # nothing new to say
        noted = msgspec.structs.replace(record, state="unschedulable", reason=reason, updated=time.time())
        written = await self.claims.replace(noted, revision) if revision else None
        if written is None:
            done = await self.claims.transition(
                event.claim, "unschedulable", lambda r: msgspec.structs.replace(r, reason=reason)
            )
            if done is None:
                self._forget(event.claim)
                return
        self._kube_unschedulable(event.claim, event.kube or record.kube, reason)
        await self.bus.publish(
            subjects.claim(event.tenant, event.claim, "unschedulable"),
            ClaimUnschedulable(claim=event.claim, tenant=event.tenant, reason=reason, filtered=filtered),
        )

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
        if record.state in ("allocated", "prepared", "running") and not record.release_requested:
            self._kube_allocated(record.claim, record.tenant, record.node, record.devices, record.kube)

    def _kube_unschedulable(self, claim: str, kube, reason: str) -> None:
        if self.kube is not None and kube is not None:
            self.kube.submit(Unschedulable(claim=claim, kube=kube, reason=reason))

    async def _give_back(self, job: Allocated, reason: str) -> None:
        """An allocation the cluster could not be told about is released as any other: a release
        addressed to the node, whose enforcer returns the ledger entry and the quota and records
        the claim released (the same message id as a forwarded release, so the two are one)."""
        await self.bus.publish(
            subjects.claim(job.tenant, job.claim, "release", job.node),
            ClaimReleaseRequested(claim=job.claim, tenant=job.tenant, reason=f"kubernetes: {reason}"),
            msg_id=f"{job.claim}:release:{job.node}",
        )

    async def cancel(self, event: ClaimReleaseRequested, addressed: bool = False) -> None:
        """Release of a claim that never reached a node is placement's to finish; a release that
        names no node for a claim that is on one is passed on to that node's enforcer."""
        record, _ = await self.claims.get(event.claim)
        self._forget(event.claim)
        if record is not None and record.tenant != event.tenant:
            raise PermanentError(f"release of {event.claim} by tenant {event.tenant!r}: the claim is not theirs")
        route = release_route(record.state, record.node) if record is not None else None
        if route is None or route.owner != "placement":
            if route is not None and not addressed:
                await self.bus.publish(route.subject(record.tenant, record.claim), event,
                                       msg_id=route.msg_id(record.claim))
            return  # on a node: the enforcer releases it
        if record.state not in UNPLACED:
            return
        done = await self.claims.transition(event.claim, "released", expect=lambda r: r.state in UNPLACED)
        if done is not None:
            # What a placement that stopped midway took: the quota reserved before its ledger
            # write, or a ledger entry whose claim record was never written.
            await self.ledger.give_back(event.tenant, event.claim, self.claim_nodes.get(event.claim))
            await self.bus.publish(
                subjects.claim(event.tenant, event.claim, "released"),
                ClaimReleased(claim=event.claim, tenant=event.tenant, reason=event.reason),
                msg_id=f"{event.claim}:released",
            )

    async def _retry_loop(self) -> None:
        """Retry unschedulable claims whenever something that could make them fit has changed."""
        while True:
            await self._retry_wanted.wait()
            await asyncio.sleep(0.05)  # coalesce a burst of changes into one pass
            self._retry_wanted.clear()
            waiting = sorted(self.pending.values(), key=lambda e: (-e.spec.priority, e.ts))
            for event in waiting:
                if event.claim not in self.pending:
                    continue
                trace = self.traces.get(event.claim)
                try:
                    with self.ctx.telemetry.span(
                        "placement retry", parent_headers={"traceparent": trace} if trace else None,
                        attributes={"tessera.claim": event.claim},
                    ):
                        await self.place(event)
                except ConflictError:
                    self._retry_wanted.set()
                except Exception as exc:  # one bad claim must not stop the retries of the others
                    log.warning("retry of %s failed: %r", event.claim, exc)


def configure():
    settings = PlacementSettings.from_env()  # ConfigError (exit 2) names a bad variable

    if settings.core == "compiled" and not COMPILED_CORE:
        raise ConfigError("TESSERA_PLACEMENT_CORE=compiled, but the compiled core (tessera.placement._fgdcore) "
                          "is not built here: reinstall services/placement where gcc and the Python headers "
                          "are present, or set TESSERA_PLACEMENT_CORE=auto")

    async def build(ctx: ServiceContext) -> dict:
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

    return build
