"""The node enforcer: where an allocation on this node becomes an enforced environment, and back.

One enforcer runs per node (``TESSERA_NODE``). For every claim allocated here it prepares what the
workload needs: a claim directory with the shared accounting file that libvgpu.so maps, the
environment with HAMi's limit variables (plus, on a simulated fleet, the simulated driver's), a
libvgpu config file holding the same limits as ceilings, and a CDI spec (cdi.py) that puts all of
it, with libvgpu.so and the GPUs' device nodes, into a container (preparation.py, shared with the
kubelet plugin); then it publishes ``prepared``. ``running`` events (from `tessera run`) move the
claim to running. On a release request it stops the claim's processes (SIGTERM, SIGKILL after the grace
period, `reclaim.Reclaimer.stopping`) and only once none is left returns the capacity to the ledger (and the
tenant's quota) and publishes ``released``: until then the GPU memory is in use, and the ledger says so.

Root tasks: the claims consumer; the observe loop (reads accounting files, publishes usage, applies
the leak policy of reclaim.py); the lost-node loop (lost.py); the reconcile loop (the start-up
reconcile, periodically: what a stop or a failed publish left half done); the watchdog loop (watchdog.py:
kills a claim's processes that use the GPU without libvgpu in force); in Kubernetes mode the kubelet plugin
(kubelet/), which prepares the claims that stand for ResourceClaims when the kubelet asks, and says
whether the kubelet has it registered (kubelet/registration.py: the node's ResourceSlices follow). Every
step checks the claim's recorded state first, so a redelivered or late event changes nothing, and a
restarted enforcer rebuilds everything from its claim directories, its checkpoint and the KV buckets.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

import msgspec

from tessera.shared import subjects
from tessera.shared.bus import Delivery, Outgoing, Subscription
from tessera.shared.claimstore import ClaimStore
from tessera.shared.errors import TemporaryError
from tessera.shared.events import (
    ClaimAllocated,
    ClaimPrepared,
    ClaimRecord,
    ClaimReleased,
    ClaimReleaseRequested,
    ClaimRunning,
    ClaimEvent,
    ClaimViolation,
    KubeletPluginStatus,
    claim_decoder,
)
from tessera.shared.ledger import Ledger
from tessera.shared.lifecycle import ON_NODE, TERMINAL, ended_with_lost_node, ends, owner_of
from tessera.shared.runner import ServiceContext
from tessera.shared.telemetry import NODE, decided

from tessera.enforcer import lost as lostmod
from tessera.enforcer.claimdir import ClaimDirs
from tessera.enforcer.driver import DriverNotFound
from tessera.enforcer.gpustats import GpuStats
from tessera.enforcer.kubelet.registration import PluginRegistration
from tessera.enforcer.metrics import EnforcerMetrics
from tessera.enforcer.observe import ClaimView, NodeView, Observer
from tessera.enforcer.preparation import Prepared, Preparation
from tessera.enforcer.processes import kill
from tessera.enforcer.reclaim import Cleanup, DropLedger, Reclaimer, Release, Signal
from tessera.enforcer.settings import EnforcerSettings
from tessera.enforcer.usage import UsageGate, claim_usage, node_usage
from tessera.enforcer.watchdog import Escapee, Watchdog

log = logging.getLogger("tessera.enforcer")

class EnforcerService:
    def __init__(self, ctx: ServiceContext, settings: EnforcerSettings) -> None:
        self.ctx = ctx
        self.bus = ctx.bus
        self.settings = settings
        self.node = settings.node
        self.dirs = ClaimDirs(settings.state_dir)
        self.preparation = Preparation(settings, self.dirs)
        self.reclaimer = Reclaimer(grace=settings.reclaim_seconds, stop_grace=settings.release_grace_seconds)
        self.lost = lostmod.LostNodes(me=settings.node, delay=settings.lost_reclaim_seconds)
        self.gate = UsageGate(heartbeat=settings.usage_heartbeat_seconds)
        self.metrics = EnforcerMetrics(settings.node, ctx.settings.metrics_legacy)
        self.watchdog = Watchdog()
        ctx.metrics.add(self.metrics)  # served by the runner's metrics listener (tessera.shared.metrics)
        self.registration: PluginRegistration | None = None  # Kubernetes mode: what the kubelet says of the plugin (set in start)

    async def start(self) -> dict:
        await self.open()
        tasks = {"claims": self._consume(), "observe": self._observe_loop(), "lost-nodes": self._lost_loop(),
                 "reconcile": self._reconcile_loop(), "watchdog": self._watchdog_loop()}
        if self.settings.kubernetes:
            instance = self.settings.pod_uid or f"{socket.gethostname()}-{os.getpid()}"
            registered = self.ctx.gate("kubelet-registration") if self.settings.ready_when_registered else None
            self.registration = PluginRegistration(self.node, instance, self._publish_plugin_status,
                                                   on_registered=registered)
            tasks["kubelet-plugin"] = self._kubelet_plugin()
            tasks["kubelet-registration"] = self.registration.report()
        return tasks

    async def open(self) -> None:
        """The buckets, directories and observer every root task uses (tests open without tasks)."""
        self.claims = ClaimStore(await self.bus.kv(subjects.KV_CLAIMS))
        self.ledger = Ledger(await self.bus.kv(subjects.KV_LEDGER))
        self.inventory_kv = await self.bus.kv(subjects.KV_INVENTORY)
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        self.settings.cdi_dir.mkdir(parents=True, exist_ok=True)
        if self.settings.vgpu_node_config:  # host mode: libvgpu refuses memory without a trusted claim file
            self.dirs.install_node_config(self.settings.vgpu_node_config)
        self.observer = Observer(self.node, self.dirs, self.claims, self.ledger, self.inventory_kv)
        self.gpustats = GpuStats(enabled=not self.settings.simulated)
        if self.settings.simulated:
            log.info("simulated fleet: workloads get the simulated driver from %s", self.settings.sim_driver_dir)
        else:
            try:
                found = self.preparation.node_files.driver
            except DriverNotFound as exc:  # looked up again at every prepare
                log.warning("%s; claims cannot be prepared until it is there", exc)
            else:
                assert found is not None
                log.info("NVIDIA driver %s: %d libraries and %d programs under %s go into the CDI specs",
                         found.version, len(found.libraries), len(found.binaries), self.settings.driver_root)
        if not self.settings.cdi_hook.is_file():
            log.warning("TESSERA_CDI_HOOK=%s does not exist here: a container runtime cannot run the CDI specs' "
                        "hook and will not start claims' containers", self.settings.cdi_hook)

    # --- Kubernetes: the kubelet's DRA plugin ----------------------------------------------------

    async def _kubelet_plugin(self) -> None:
        from tessera.enforcer.kubelet.health import DeviceHealth
        from tessera.enforcer.kubelet.kube import ClaimReader
        from tessera.enforcer.kubelet.plugin import DraPlugin
        from tessera.enforcer.kubelet.server import serve

        ready = self.ctx.gate("kubelet-plugin")
        reader = ClaimReader()
        plugin = DraPlugin(self.settings, self.preparation, self.ledger, self.claims, reader,
                           inventory=self._devices, announce=self.announce_prepared, span=self.ctx.telemetry.span)
        try:
            await reader.connect()
            await plugin.restore()
            await serve(plugin, self.settings.kubelet_registry_dir, self.settings.kubelet_plugin_dir, ready,
                        self.settings.pod_uid, DeviceHealth(self.node, self._current_devices), self.registration)
        finally:
            await reader.close()

    async def _publish_plugin_status(self, status: KubeletPluginStatus) -> None:
        await self.bus.publish(subjects.usage(self.node), status,
                               msg_id=f"plugin:{self.node}:{status.instance}:{time.time_ns()}")

    async def _current_devices(self):
        """The node's GPUs as its inventory says now (for the kubelet's health stream)."""
        await self.observer.inventory()
        return list(self.observer.devices.values())

    async def _devices(self):
        if not self.observer.devices:
            await self.observer.inventory()
        return self.observer.devices

    # --- the claims consumer -------------------------------------------------------------------

    async def _consume(self) -> None:
        await self.reconcile()
        await self.bus.consume(Subscription(
            stream=subjects.STREAM_CLAIMS,
            durable=f"enforcer-{subjects.token(self.node.replace('.', '_'))}",
            # Only this node's events: the server filters on the subject's node token.
            filter_subjects=[
                subjects.claims_of_kind("allocated", self.node),
                subjects.claims_of_kind("release", self.node),
                subjects.claims_of_kind("running", self.node),
            ],
            decoder=claim_decoder,
            handler=self.handle,
        ))

    async def _reconcile_loop(self) -> None:
        """The start-up reconcile again, periodically: a step that failed after its record changed
        (a publish that timed out, a claim allocated while the consumer was giving up on it) is
        finished by the next pass instead of waiting for the next restart."""
        while True:
            await asyncio.sleep(self.settings.reconcile_seconds)
            try:
                await self.reconcile()
            except TemporaryError as exc:
                log.warning("reconcile: %s", exc)

    async def reconcile(self) -> None:
        """Finish what the records say is half done on this node (at start: from empty memory).

        Running workloads need no adoption step: the observe loop finds them through their claim
        directories (owner locks, accounting files) like any other, and releases the orphans; it
        also removes the directories of claims that are no longer live here."""
        for record in await self.claims.all():
            if record.node != self.node:
                continue
            try:
                await self._reconcile_one(record)
            except TemporaryError as exc:  # this claim waits for the next pass; the others go on
                log.warning("reconcile %s: %s", record.claim, exc)

    async def _reconcile_one(self, record: ClaimRecord) -> None:
        if record.state == "released":
            await self._finish_release(record)
            return
        if record.release_requested and ends("enforcer", record.state, record.node, self.node):
            await self.stop_then_release(record, record.reason or "requested")
            return
        if record.state not in ON_NODE:
            return
        # A ResourceClaim's claim is prepared by the kubelet plugin (its checkpoint restores it),
        # but an event it failed to publish is owed all the same.
        if not self.kubelet_prepares(record) and (record.state == "allocated" or not self.dirs.of(record.claim).exists()):
            await self.prepare(record)
        if record.state == "prepared":
            await self._republish_prepared(record)

    async def _republish_prepared(self, record: ClaimRecord) -> None:
        """A record moved to ``prepared`` by an enforcer that stopped before publishing the event:
        publish it now, from the directory that is there (same message id as the first attempt)."""
        subject = subjects.claim(record.tenant, record.claim, "prepared", self.node)
        if await self.bus.stored(subjects.STREAM_CLAIMS, subject):
            return
        if not self.preparation.present(record.claim):
            return  # nothing on disk to announce (the kubelet unprepared it, or it is being restored)
        prepared = self.preparation.materialize(record.claim, record.devices, await self._devices(),
                                                task_priority=record.spec.task_priority)
        await self._publish_prepared(record, prepared)
        log.warning("republished prepared for %s (its event was never published)", record.claim)

    def kubelet_prepares(self, record: ClaimRecord) -> bool:
        """A ResourceClaim's claim is prepared when the kubelet asks (pod about to start), not on
        ``allocated``: preparing it here too would bring back what the kubelet unprepared."""
        return self.settings.kubernetes and record.kube is not None

    async def handle(self, event: ClaimEvent, delivery: Delivery) -> None:
        match event:
            case ClaimAllocated() if event.node == self.node:
                record, _ = await self.claims.get(event.claim)
                if record is not None and record.node == self.node \
                        and owner_of(record.state, "prepared") == "enforcer" and not self.kubelet_prepares(record):
                    await self.prepare(record)
                else:
                    decided(record or event, "unchanged", self._why_not_mine(record, "prepare"))
            case ClaimRunning() if event.node == self.node:
                record, _ = await self.claims.get(event.claim)
                if record is not None and record.node == self.node and record.state == "prepared":
                    if await self.claims.transition(event.claim, "running") is not None:
                        decided(record, "running", f"pids {' '.join(map(str, event.pids))}")
                        log.info("running %s (pids %s)", event.claim, event.pids)
            case ClaimReleaseRequested():
                # Addressed to this node (by the translator, or passed on by placement); a claim
                # prepared after its release was requested finds the request on its record instead.
                # The lifecycle says whether it is this enforcer's to end (on this node, not over).
                record, _ = await self.claims.get(event.claim)
                if record is not None and record.tenant == event.tenant \
                        and ends("enforcer", record.state, record.node, self.node):
                    await self.stop_then_release(record, event.reason)
                else:
                    decided(record or event, "unchanged", self._why_not_mine(record, "release"))
            case _:
                return

    def _why_not_mine(self, record: ClaimRecord | None, step: str) -> str:
        """The ``tessera.decision.reason`` of an event this enforcer has nothing to do for."""
        if record is None:
            return "no such claim"
        if record.node != self.node:
            return f"the claim is on {record.node or 'no node'}, not {self.node}"
        if step == "prepare" and self.kubelet_prepares(record):
            return "the kubelet prepares a ResourceClaim's claim"
        return f"the claim is {record.state}: nothing to {step}"

    # --- prepare and release --------------------------------------------------------------------

    async def prepare(self, record: ClaimRecord) -> None:
        if record.release_requested:  # released before we got to it: nothing to prepare
            await self.stop_then_release(record, record.reason or "release requested")
            return
        problem = await self._ledger_problem(record)
        if problem is not None:
            # Preparing would hand out GPUs the ledger does not hold for this claim, which another
            # claim may then be sold. Placement's reconciler repairs the ledger; until then the
            # event is retried (and dead-lettered with this reason if it never is).
            raise TemporaryError(f"not preparing {record.claim}: {problem}", delay=1.0)
        prepared = self.preparation.materialize(record.claim, record.devices, await self._devices(),
                                                workload_uid=record.spec.workload_uid,
                                                task_priority=record.spec.task_priority)
        if record.state != "allocated":
            decided(record, "restored", f"the claim is {record.state}: its directory was made again")
            log.info("restored the directory of %s (%s)", record.claim, record.state)
            return
        await self.announce_prepared(record, prepared)

    async def _ledger_problem(self, record: ClaimRecord) -> str | None:
        """Why this node's ledger does not back the record's devices, or None if it does."""
        ledger, _ = await self.ledger.read_node(self.node)
        entry = ledger.entries.get(record.claim)
        if entry is None:
            return f"the ledger of {self.node} holds no entry for it"
        if sorted(entry.shares, key=lambda s: s.uuid) != sorted(record.devices, key=lambda s: s.uuid):
            return f"its record's devices differ from the ledger of {self.node}"
        return None

    async def announce_prepared(self, record: ClaimRecord, prepared: Prepared) -> None:
        """Move an allocated claim to ``prepared`` and say so on the bus (whichever path prepared it).

        A stop between the two leaves a ``prepared`` record without its event: ``reconcile``
        publishes it then."""
        done = await self.claims.transition(record.claim, "prepared")
        if done is None:
            decided(record, "unchanged", "released while it was being prepared")
            return  # released meanwhile: the observe loop cleans up
        await self._publish_prepared(record, prepared)
        decided(record, "prepared")

    async def _publish_prepared(self, record: ClaimRecord, prepared: Prepared) -> None:
        await self.bus.publish(
            subjects.claim(record.tenant, record.claim, "prepared", self.node),
            ClaimPrepared(
                claim=record.claim, tenant=record.tenant, node=self.node, env=prepared.env,
                cache_path=str(prepared.directory.cache), cdi_device=prepared.cdi_device,
            ),
            msg_id=f"{record.claim}:prepared",
        )
        log.info("prepared %s (%s)", record.claim, ", ".join(f"{s.uuid}:{s.memory_mib}MiB" for s in record.devices))

    async def stop_then_release(self, record: ClaimRecord, reason: str) -> None:
        """A release request for a claim of this node: its processes are stopped first, and the
        release (``release``) follows once none is left, now or from a later look of the observe
        loop. The record is marked release-requested first (where the requester did not), so that
        the observe loop, and this enforcer after a restart, carry the stop on."""
        if not record.release_requested:
            record = await self.claims.mark_release_requested(record.claim, reason) or record
        cv = await self.observer.look(record.claim)
        if cv.record is None or cv.record.state not in ON_NODE:
            return  # released (or failed) meanwhile
        for action in self.reclaimer.stopping(cv, reason):
            await self._apply_one(cv, action)

    async def release(self, record: ClaimRecord, reason: str, *, node: str | None = None) -> bool:
        """Return the claim's capacity and publish ``released``; True if this call released it.
        On this node, only once no process of the claim is left (``stop_then_release``); a lost
        node's claims are released by a peer, which cannot see their processes.

        ``node`` is the node whose ledger holds the claim (another one for a lost node's claims).
        The ledger entry goes last: until it is gone, whoever finds it (this node's reconcile and
        janitor, a lost node's releasers) finishes the release, so a stop at any step is resumed
        by re-running from the top; every step is idempotent. (A stop after the quota return and
        before the entry goes leaves the tenant charged for nothing meanwhile, never the reverse.)"""
        node = node or record.node or self.node
        await self.ledger.return_quota(record.tenant, record.claim)
        current, _ = await self.claims.get(record.claim)
        if current is not None and current.state == "released":
            await self._finish_release(current, node=node)
            return False
        done = await self.claims.transition(
            record.claim, "released", lambda r: msgspec.structs.replace(r, reason=reason)
        )
        if done is None:  # failed meanwhile, or gone: its capacity is still not anyone's
            await self.ledger.release(node, record.claim)
            return False
        await self._finish_release(done, node=node, resumed=False)
        decided(record, "released", reason, span=None, **{NODE: node})  # (span=None: the current one)
        log.info("released %s on %s (%s)", record.claim, node, reason)
        return True

    async def _finish_release(self, record: ClaimRecord, *, node: str | None = None, resumed: bool = True) -> None:
        """The steps of a release after its record says ``released``: quota, event, ledger entry.
        ``resumed``: finishing another run's release, which is unfinished while its entry is there."""
        node = node or record.node or self.node
        if resumed:
            ledger, _ = await self.ledger.read_node(node)
            if record.claim not in ledger.entries:
                return  # finished before
        await self.ledger.return_quota(record.tenant, record.claim)
        await self.bus.publish(
            subjects.claim(record.tenant, record.claim, "released", node),
            ClaimReleased(claim=record.claim, tenant=record.tenant, node=node, reason=record.reason),
            msg_id=f"{record.claim}:released",
        )
        await self.ledger.release(node, record.claim)

    # --- observe: usage, metrics, leaks ---------------------------------------------------------

    async def _observe_loop(self) -> None:
        period = min(self.settings.usage_seconds, self.settings.tick_seconds)
        while True:
            try:
                await self.observe_once()
            except TemporaryError as exc:
                log.warning("observe: %s", exc)
            except OSError as exc:
                log.error("observe: %s", exc)
            await asyncio.sleep(period)

    async def observe_once(self) -> NodeView:
        view = await self.observer.observe()
        usages = [u for u in (claim_usage(self.node, cv) for cv in view.claims.values()) if u is not None]
        gpu = await asyncio.to_thread(self.gpustats.sample) if self.gpustats.nvml is not None else {}
        self.metrics.update(view, usages, gpu)
        await self._publish_usage(view, usages)
        await self._apply(view, self.reclaimer.decide(view))
        return view

    async def _publish_usage(self, view: NodeView, usages) -> None:
        items = [Outgoing(subjects.usage(self.node), u, f"usage:{self.node}:{u.claim}:{time.time_ns()}")
                 for u in usages if self.gate.due(u.claim, u)]
        total = node_usage(view, usages)
        if self.gate.due("", total):
            items.append(Outgoing(subjects.usage(self.node), total, f"usage:{self.node}:{time.time_ns()}"))
        self.gate.forget_except({u.claim for u in usages} | {""})
        if items:
            try:
                await self.bus.publish_many(items)
            except Exception as exc:  # usage is a report, not state: the next change or heartbeat resends it
                for name in [getattr(o.event, "claim", "") for o in items]:  # "": the node's total
                    self.gate.last.pop(name, None)
                log.warning("usage publish failed: %r", exc)

    async def _apply(self, view: NodeView, actions) -> None:
        for action in actions:
            await self._apply_one(view.claims[action.claim], action)

    async def _apply_one(self, cv: ClaimView, action) -> None:
        match action:
            case Release(claim=claim, reason=reason):
                if cv.record is not None and await self.release(cv.record, reason):
                    if not cv.record.release_requested:  # (a requested release is no reclaim)
                        self.metrics.reclaimed[reason] += 1
                        log.warning("reclaimed %s: %s", claim, reason)
            case Signal(claim=claim, sig=sig):
                pids = await asyncio.to_thread(kill, cv.processes, sig)
                state = cv.record.state if cv.record else "unknown"
                if cv.live and cv.record is not None:
                    why = "its release waits for them" if cv.record.release_requested else "reclaimed"
                    log.warning("claim %s (%s): sent %s to its processes %s (%s)", claim, state,
                                signal.Signals(sig).name, pids, why)
                elif pids:
                    log.warning("claim %s is %s but processes %s still use it: sent %s", claim, state, pids,
                                signal.Signals(sig).name)
            case Cleanup(claim=claim):
                self.preparation.remove(claim)
                log.info("removed the directory of %s", claim)
            case DropLedger(claim=claim):
                await self._drop_orphan(claim)

    async def _drop_orphan(self, claim: str) -> None:
        """A ledger entry of this node whose claim is not live here: removed only if the record,
        read now, says the claim is over (or never existed). A record still on its way (placement
        wrote the ledger and has not yet written ``allocated``, or is re-placing it) keeps its entry:
        dropping it would let the redelivered allocation run on GPUs the ledger sells again."""
        record, _ = await self.claims.get(claim)
        if record is not None and record.state not in TERMINAL:
            log.info("kept ledger entry %s: its record is %s on %r (placement's to settle)",
                     claim, record.state, record.node)
            return
        if record is not None and record.state == "released" and record.node == self.node:
            await self._finish_release(record)
            return
        entry = await self.ledger.release(self.node, claim)
        if entry is not None:
            await self.ledger.return_quota(entry.tenant, claim)
            log.warning("dropped orphan ledger entry %s (claim %s)", claim, record.state if record else "unknown")

    # --- the watchdog: processes that escape libvgpu -------------------------------------------

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.watchdog_seconds)
            for escapee in await asyncio.to_thread(self.watchdog.sweep, self.dirs.all()):
                try:
                    await self.report_escapee(escapee)
                except TemporaryError as exc:  # killed all the same; the log line and metric say so
                    log.warning("violation event of %s not published: %s", escapee.claim, exc)

    async def report_escapee(self, e: Escapee) -> None:
        """A killed escapee: the log line (pid and reason), the metric, the claim's ``violation`` event."""
        self.metrics.escapees[e.kind] += 1
        log.warning("claim %s: killed pid %d: %s", e.claim, e.pid, e.reason)
        record, _ = await self.claims.get(e.claim)
        if record is None:
            return
        await self.bus.publish(
            subjects.claim(record.tenant, e.claim, "violation", self.node),
            ClaimViolation(claim=e.claim, tenant=record.tenant, node=self.node, pid=e.pid, reason=e.reason),
            msg_id=f"{e.claim}:violation:{e.pid}:{e.start_time}",
        )

    # --- lost nodes -----------------------------------------------------------------------------

    async def _lost_loop(self) -> None:
        period = max(0.2, min(self.settings.lost_reclaim_seconds / 4, 5.0))
        while True:
            await asyncio.sleep(period)
            try:
                await self.release_lost_once()
            except TemporaryError as exc:
                log.warning("lost-node check: %s", exc)

    async def release_lost_once(self) -> None:
        inventory = await lostmod.read_inventory(self.inventory_kv)
        lost = [n for n, inv in inventory.items() if inv.labels.get(lostmod.LOST_LABEL) == "true" and n != self.node]
        ledgers = {}
        for node in lost:
            ledger, _ = await self.ledger.read_node(node)
            ledgers[node] = sorted(ledger.entries)
        for node, claim in self.lost.due(inventory, ledgers):
            record, _ = await self.claims.get(claim)
            reason = f"node {node} lost"
            if record is not None and ended_with_lost_node(record.state):
                if await self.release(record, reason, node=node):
                    self.metrics.reclaimed["node lost"] += 1
                    log.warning("released %s of lost node %s", claim, node)
            elif record is not None and record.state == "released":
                await self._finish_release(record, node=node)  # a releaser stopped half way
            else:
                ledger, _ = await self.ledger.read_node(node)
                entry = ledger.entries.get(claim)
                if entry is not None:
                    await self.ledger.return_quota(entry.tenant, claim)
                    await self.ledger.release(node, claim)


async def build(ctx: ServiceContext, settings: EnforcerSettings) -> dict:
    return await EnforcerService(ctx, settings).start()
