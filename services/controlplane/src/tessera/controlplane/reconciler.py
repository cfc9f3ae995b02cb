"""The reconciler: drive each tenant from its stored spec to the world, and report what it saw.

Reconcile, don't remember: every pass starts from the controlplanes bucket and the real systems
(datastore server, host cluster), never from this process's memory. Each step is idempotent, so a
second create is harmless, a manager restarted from empty memory converges on its first resync, and
a deletion interrupted half-way is finished by the next pass. A per-tenant lock only keeps one
process from racing itself; replicas are kept apart by compare-and-set on the record.

A tenant put to sleep (``asleep`` on its record) is rendered with zero replicas and shown
NotReady/Sleeping, whatever its host makes of zero replicas; a woken one is NotReady/Waking until its
first Ready pass, which records how long the wake took (``status.wake_seconds``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Awaitable, Callable, Mapping

import msgspec

from tessera.controlplane import manifests
from tessera.controlplane.claimdrain import ClaimDrain, Remaining
from tessera.controlplane.credentials import TenantSecrets
from tessera.controlplane.datastores import DatastoreDriver, DatastoreFault
from tessera.controlplane.host import HostCluster, HostFault
from tessera.controlplane.pki import PkiAuthority
from tessera.controlplane.sealing import Unopenable
from tessera.controlplane.spec import Phase, TenantControlPlane, TenantControlPlaneStatus
from tessera.controlplane.store import TenantStore
from tessera.shared import subjects
from tessera.shared.errors import ConflictError, TemporaryError
from tessera.shared.events import GpuQuota, TenantCreated, TenantDeleted, TenantRecord, TenantUpdated

if TYPE_CHECKING:  # (imported by the manager only in Kubernetes mode)
    from tessera.controlplane.tenantpods.running import TenantPods

log = logging.getLogger("tessera.controlplane.reconciler")

Publish = Callable[[str, msgspec.Struct, str], Awaitable[object]]

CLOSED = GpuQuota(gpus=0, memory_mib=0, cores=0)  # a deleted tenant's quota: nothing more is placed


class Reconciler:
    def __init__(
        self,
        store: TenantStore,
        publish: Publish,
        drivers: Mapping[str, DatastoreDriver],
        pki: PkiAuthority,
        host: HostCluster,
        platform_namespace: str = "tessera-system",
        *,
        claims: ClaimDrain,
        teardown_wait: float = 20.0,
        pods: TenantPods | None = None,
    ) -> None:
        self.pods = pods  # Kubernetes mode: each Ready tenant's pod syncer
        self.claims = claims
        self.teardown_wait = teardown_wait
        self.platform_namespace = platform_namespace
        self.store = store
        self.publish = publish
        self.drivers = drivers
        self.pki = pki
        self.host = host
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def reconcile(self, name: str, *, wait: float | None = None) -> TenantControlPlane | None:
        """One pass for one tenant; returns the record as now stored (None once deleted; a record
        marked deleting while its claims are still being released). ``wait``: how long a deletion
        waits for them (default: the teardown wait)."""
        async with self._locks[name]:
            for _ in range(20):
                try:
                    return await self._pass(name, self.teardown_wait if wait is None else wait)
                except ConflictError:
                    continue  # someone else wrote the record: re-read and go again
            raise TemporaryError(f"tenant {name}: record kept changing during reconcile")

    async def resync(self, *, wait: float = 0.0) -> None:
        """Re-seal what is not under the newest key, reconcile every stored tenant and clean up public
        records with no desired state. A pending deletion is looked at without waiting (``wait``): one
        stuck tenant does not hold up the others."""
        await self.store.reseal_secrets()
        names = set(await self.store.controlplanes.keys())
        for name in sorted(names):
            try:
                await self.reconcile(name, wait=wait)
            except Exception as exc:  # one tenant's failure must not stop the others
                log.warning("reconcile %s failed: %s", name, exc)
        for orphan in set(await self.store.tenants.keys()) - names:
            try:
                async with self._locks[orphan]:
                    if await self.store.controlplanes.get(orphan) is not None:
                        continue  # created since the list above: not an orphan (its teardown would delete it)
                    await self._teardown(orphan, uid=None, wait=wait)
            except Exception as exc:
                log.warning("removing orphaned tenant record %s failed: %s", orphan, exc)

    async def _pass(self, name: str, wait: float) -> TenantControlPlane | None:
        stored = await self.store.controlplanes.get(name)
        if stored is None:
            return None
        record = stored.value
        if record.deleting:
            if await self._teardown(name, uid=record.uid, record=record, wait=wait):
                return None
            left = await self.store.controlplanes.get(name)
            return left.value if left is not None else None
        phase, reason, message, endpoint, scope, not_after = await self._converge(record)
        phase, reason, message = _sleeping_or_waking(record, phase, reason, message)
        waking_since, wake_seconds = record.waking_since, record.status.wake_seconds
        if waking_since and phase == "Ready":  # woken: how long it took, from the wake asked for
            waking_since, wake_seconds = 0.0, time.time() - record.waking_since
            log.info("tenant %s: awake, Ready %.2f s after the wake", name, wake_seconds)
        if self.pods is not None:  # the syncer needs the tenant's API server: it runs while that is Ready
            if phase == "Ready":
                await self.pods.start(record)
            else:
                await self.pods.stop(name)
        status = TenantControlPlaneStatus(
            phase=phase,
            reason=reason,
            message=message,
            observed_generation=record.generation,
            endpoint=endpoint,
            datastore=scope,
            certificates_not_after=not_after,
            last_transition=record.status.last_transition,
            gpu_pods=self.pods.status(name) if self.pods is not None else "",
            wake_seconds=wake_seconds,
        )
        first = record.status.observed_generation == 0
        changed = (
            first
            or record.status.phase != phase
            or record.status.observed_generation != record.generation
            or record.status.reason != reason
        )
        if changed:
            status.last_transition = time.time()
        quota = record.spec.quota.to_quota()
        await self._publish_record(name, TenantRecord(tenant=name, quota=quota, phase=phase, created=record.created,
                                                      borrowing_limit=record.spec.quota.borrowing(),
                                                      weight=record.spec.quota.weight))
        if not changed and record.status == status and record.waking_since == waking_since:
            return record
        updated = msgspec.structs.replace(record, status=status, waking_since=waking_since)
        await self.store.controlplanes.put(name, updated, revision=stored.revision)
        if first:
            await self.publish(
                subjects.tenant(name, "created"),
                TenantCreated(tenant=name, quota=quota),
                f"{name}.{record.uid}.created",
            )
        if changed:
            await self.publish(
                subjects.tenant(name, "updated"),
                TenantUpdated(tenant=name, quota=quota, phase=phase, reason=reason),
                # (the transition's time too: a tenant put to sleep and woken goes through the same
                # phases again, which are new events, not repeats for the stream to drop)
                f"{name}.{record.uid}.g{record.generation}.{phase}.{reason}.{status.last_transition:.3f}",
            )
        return updated

    async def look(self, name: str) -> TenantControlPlane | None:
        """The tenant as stored, after a pass if it is waking and its host says it serves now: a wake's
        wait asks the host (a cheap look) often, and runs the full pass only when it will say Ready."""
        stored = await self.store.controlplanes.get(name)
        record = stored.value if stored is not None else None
        if record is None or record.asleep or record.status.phase == "Ready":
            return record
        try:
            ready, _ = await self.host.ready(name)
        except Exception:  # (a fault: the pass that comes with the next change or resync names it)
            ready = False
        return await self.reconcile(name) if ready else record

    async def _converge(self, record: TenantControlPlane) -> tuple[Phase, str, str, str, str, float]:
        name = record.name
        try:
            stored = await self.store.secrets.get(name)
        except Unopenable as exc:
            # Never replaced by new secrets: the key may be restored; the tenant's status says why.
            log.error("tenant %s: %s", name, exc)
            return ("NotReady", "SecretsUnreadable", str(exc), "", "", record.status.certificates_not_after)
        secrets = stored.value if stored else TenantSecrets(tenant=name)
        before = msgspec.json.encode(secrets)
        driver = self.drivers.get(record.spec.datastore.driver)
        if driver is None:
            return ("NotReady", "DatastoreNotConfigured",
                    f"datastore driver {record.spec.datastore.driver!r} is not configured on this manager: add it to "
                    f"its TESSERA_CP_DRIVERS (with that driver's settings), or choose one it offers: "
                    f"{', '.join(sorted(self.drivers)) or 'none'}", "", "", 0.0)
        try:
            secrets.datastore = await driver.ensure(name, secrets.datastore)
        except DatastoreFault as exc:  # the driver knows what is wrong: the status names it
            log.warning("tenant %s: datastore: %s: %s", name, exc.reason, exc)
            return ("NotReady", exc.reason, str(exc), "", "", secrets.not_after)
        except Exception as exc:
            log.warning("tenant %s: datastore: %s", name, exc)
            return ("NotReady", DatastoreFault.reason, f"{type(exc).__name__}: {exc}", "", "", secrets.not_after)
        # (a host that runs the control plane itself knows where it answers: local processes)
        endpoint = getattr(self.host, "endpoint", manifests.endpoint)(record)
        self.pki.ensure(record, secrets, endpoint, manifests.namespace(name))
        if msgspec.json.encode(secrets) != before:
            await self.store.secrets.put(name, secrets, revision=stored.revision if stored else None)
        objects = manifests.render(record, secrets, self.platform_namespace)
        try:
            manifests.validate(objects)
        except manifests.InvalidManifest as exc:  # a bug in rendering, not the tenant's fault
            log.error("tenant %s: %s", name, exc)
            return ("NotReady", "InvalidManifest", str(exc), endpoint, secrets.datastore.scope, secrets.not_after)
        try:
            await self.host.apply(name, objects)
            ready, why = await self.host.ready(name)
        except HostFault as exc:  # the host knows what is wrong: the status names it
            log.warning("tenant %s: %s: %s", name, exc.reason, exc)
            return ("NotReady", exc.reason, str(exc), endpoint, secrets.datastore.scope, secrets.not_after)
        except Exception as exc:
            log.warning("tenant %s: host cluster: %s", name, exc)
            return ("NotReady", "HostApplyFailed", str(exc), endpoint, secrets.datastore.scope, secrets.not_after)
        if ready:
            phase: Phase = "Ready"
            reason = "Ready"
        else:
            phase = "Upgrading" if record.status.phase == "Ready" else "Provisioning"
            reason = "WaitingForControlPlane"
        return (phase, reason, why, endpoint, secrets.datastore.scope, secrets.not_after)

    async def _publish_record(self, name: str, record: TenantRecord) -> None:
        current = await self.store.tenants.get(name)
        if current is not None and _published(current.value) == _published(record):
            return
        await self.store.tenants.put(name, record, revision=current.revision if current else None)

    async def _teardown(self, name: str, uid: str | None, record: TenantControlPlane | None = None,
                        *, wait: float = 0.0) -> bool:
        """Release the tenant's claims, then remove everything it owns, in the reverse order of
        creation; safe to repeat. True once it is gone; False while claims are left (it stays)."""
        await self._close_quota(name, uid)

        async def progress(left: Remaining) -> None:
            if left:
                await self._show_teardown(name, "ReleasingClaims", f"releasing the tenant's claims: {left.describe()}")

        # Only a delete that waits shows "ReleasingClaims"; a resync's look (no wait) would otherwise
        # flip a pending deletion's reason back and forth between it and ClaimsNotReleased.
        left = await self.claims.drain(name, wait, progress if wait > 0 else None)
        if not left:
            # Quota record gone: the translator refuses the tenant's submits from here on. A claim
            # that slipped in before is released now, and the tenant stays until it is.
            await self.store.tenants.delete(name)
            left = await self.claims.drain(name, 0.0)
            if left:
                await self._close_quota(name, uid)
        if left:
            message = (f"deletion waits for the tenant's claims to be released: {left.describe()}; the manager"
                       f" tries again on every resync")
            log.warning("tenant %s: %s", name, message)
            await self._show_teardown(name, "ClaimsNotReleased", message)
            return False
        if self.pods is not None:
            await self.pods.remove(record, name)
        await self.host.remove(name)
        try:
            stored = await self.store.secrets.get(name)
        except Unopenable as exc:  # what it names is deleted all the same
            log.warning("tenant %s: tearing down without its secrets: %s", name, exc)
            stored = None
        drivers = [self.drivers[record.spec.datastore.driver]] if record and record.spec.datastore.driver in self.drivers else []
        if stored and stored.value.datastore and stored.value.datastore.driver in self.drivers:
            drivers.append(self.drivers[stored.value.datastore.driver])
        for driver in {id(d): d for d in drivers}.values():
            await driver.remove(name)
        await self.store.secrets.delete(name)
        await self.store.tenants.delete(name)
        await self.store.controlplanes.delete(name)
        await self.publish(
            subjects.tenant(name, "deleted"),
            TenantDeleted(tenant=name),
            f"{name}.{uid or 'orphan'}.deleted",
        )
        return True

    async def _close_quota(self, name: str, uid: str | None) -> None:
        """Quota to zero and phase Deleting in the public record (what placement reads), once."""
        current = await self.store.tenants.get(name)
        closed = TenantRecord(tenant=name, quota=CLOSED, phase="Deleting",
                              created=current.value.created if current else time.time())
        if current is not None and current.value.quota == CLOSED and current.value.phase == "Deleting":
            return
        await self.store.tenants.put(name, closed, revision=current.revision if current else None)
        await self.publish(
            subjects.tenant(name, "updated"),
            TenantUpdated(tenant=name, quota=CLOSED, phase="Deleting", reason="ReleasingClaims"),
            f"{name}.{uid or 'orphan'}.deleting",
        )

    async def _show_teardown(self, name: str, reason: str, message: str) -> None:
        """Say on the tenant's record how its deletion stands (``tessera tenant get``, the object's status)."""
        def change(record: TenantControlPlane | None) -> TenantControlPlane | None:
            if record is None or not record.deleting or (record.status.reason, record.status.message) == (reason, message):
                return None
            status = msgspec.structs.replace(record.status, phase="Deleting", reason=reason, message=message,
                                             last_transition=time.time())
            return msgspec.structs.replace(record, status=status)

        await self.store.controlplanes.modify(name, change)


SLEEPING = "scaled to zero, its data kept (`tessera tenant wake` starts it)"


def _sleeping_or_waking(record: TenantControlPlane, phase: Phase, reason: str, message: str) -> tuple[Phase, str, str]:
    """What a sleeping or waking tenant's status says where the host only reports "not serving": a
    sleeping tenant is NotReady/Sleeping (its host may call zero replicas rolled out and ready), a
    waking one NotReady/Waking until Ready. A fault the pass found (the datastore, the host) is shown
    as it is."""
    if record.asleep and (phase != "NotReady" or reason == "Sleeping"):
        return "NotReady", "Sleeping", SLEEPING
    if record.waking_since and not record.asleep and phase in ("Provisioning", "Upgrading"):
        return "NotReady", "Waking", message
    return phase, reason, message


def _published(record: TenantRecord) -> tuple:
    """What placement reads of a tenant's record (its creation time aside)."""
    return (record.quota, record.phase, record.borrowing_limit, record.weight)
